"""Host page bookkeeping of the paged KV cache: allocation, sharing, release, the prefix cache (chained
hashes per weights identity, longest-prefix lookup, LRU eviction of unheld pages), and determinism."""

import pytest

from tx.sampling.kv_pages import PageTable, page_hashes


def test_allocate_share_release_and_the_trash_page():
    pt = PageTable(num_pages=6, page_size=4)
    assert pt.available == 5
    a = pt.allocate(3)
    assert a == [1, 2, 3] and pt.in_use == 3 and 0 not in a
    assert pt.allocate(3) is None and pt.available == 2  # all-or-nothing
    pt.retain(a[:2])  # a second sequence shares the prompt's first two pages
    pt.release(a)
    assert [pt.refcount(p) for p in a] == [1, 1, 0] and pt.in_use == 2
    assert pt.allocate(3) == [3, 4, 5]  # freed page 3 is reused first (LIFO free list)
    pt.release(a[:2])
    assert pt.in_use == 3 and pt.stats.peak_in_use == 5
    with pytest.raises(ValueError, match="page 1 is not held"):
        pt.release([1])
    with pytest.raises(ValueError, match="page 0 is not a page of this pool"):
        pt.retain([0])
    with pytest.raises(ValueError, match="page 2 is free"):
        pt.retain([2])
    with pytest.raises(ValueError, match="kv_cache_pages=1"):
        PageTable(num_pages=1, page_size=4)


def test_hashes_chain_and_depend_on_identity_and_every_token():
    tokens = list(range(100, 111))  # 2 full pages of 4 and 3 tokens left over
    h = page_hashes("base|slot1|v0", tokens, 4)
    assert len(h) == 2 and h == page_hashes("base|slot1|v0", tokens, 4)
    assert page_hashes("base|slot1|v1", tokens, 4)[0] != h[0]  # other weights: other K/V
    changed = tokens[:2] + [7] + tokens[3:]
    assert all(a != b for a, b in zip(page_hashes("base|slot1|v0", changed, 4), h))  # page 2 hashes its prefix
    assert page_hashes("base|slot1|v0", tokens[:4] + [1, 2, 3, 4], 4)[0] == h[0]


def test_prefix_lookup_publish_and_lru_eviction():
    pt = PageTable(num_pages=7, page_size=2)
    conv = [5, 6, 7, 8, 9, 10, 11]
    pages = pt.allocate(4)
    assert pt.publish("w", conv, pages) == 3  # 3 full pages; the partial 4th is never published
    pt.release(pages)
    assert pt.in_use == 0 and pt.available == 6
    hit = pt.lookup("w", conv + [12, 13])  # a resent, longer conversation
    assert hit == pages[:3] and pt.in_use == 3 and pt.stats.hit_pages == 3
    assert pt.lookup("other-weights", conv) == [] and pt.lookup("w", [5, 6, 0, 0]) == [pages[0]]
    pt.release(hit + [pages[0]])
    # LRU: page pages[0] was released last, so pages[1] and pages[2] are evicted first once the free list ends
    fresh = pt.allocate(pt.available - 1)
    assert pages[0] not in fresh and pt.stats.evicted == 2 and pt.lookup("w", conv) == [pages[0]]
    pt.forget()
    assert pt.lookup("w", conv) == []


def test_forgetting_identities_frees_their_unheld_pages_for_reuse_before_unused_ones():
    """Pages cached under the dropped identities leave the cache: unheld ones are free and handed out before
    pages never used (on CPU an unused pool page costs no memory), held ones stay held until released, and
    other identities' pages stay cached."""
    pt = PageTable(num_pages=12, page_size=2)
    old, other, held = pt.allocate(3), pt.allocate(2), pt.allocate(2)
    pt.publish("lora:1:0", [1, 2, 3, 4, 5, 6], old)
    pt.publish("lora:2:0", [1, 2, 3, 4], other)
    pt.publish("row:7:1", [9, 9, 8, 8], held)
    pt.release(old + other)
    assert pt.forget({"lora:1:0", "row:7:1"}) == 5
    assert pt.lookup("lora:1:0", [1, 2, 3, 4, 5, 6]) == [] and pt.lookup("row:7:1", [9, 9, 8, 8]) == []
    assert [pt.refcount(p) for p in held] == [1, 1] and not any(pt.is_cached(p) for p in old + held)
    assert sorted(pt.allocate(3)) == sorted(old)  # the dropped pages first, not pages 8.. never used
    pt.release(held)
    assert sorted(pt.allocate(2)) == sorted(held)  # uncached: freed when released
    assert pt.lookup("lora:2:0", [1, 2, 3, 4]) == other  # another identity's pages stay cached
    assert pt.forget({"gone"}) == 0


def test_first_copy_of_a_prefix_wins_and_same_calls_same_decisions():
    def history():
        pt = PageTable(num_pages=9, page_size=2)
        a, b = pt.allocate(2), pt.allocate(2)
        added = (pt.publish("w", [1, 2, 3, 4], a), pt.publish("w", [1, 2, 3, 4], b))
        pt.release(a + b)
        return added, pt.allocate(8), pt.stats
    first = history()
    assert first[0] == (2, 0) and first == history()
