"""The paged engine's KV-cache manager: pool geometry, admission against the free pages (prompt, first call,
the live rows' next call), prompt and row pages with a shared cached prefix, freeing, publish -> lookup, and
LRU eviction of cached pages under pressure; each against page counts worked out by hand. Pool of 11 pages
(page 0 reserved) of 4 positions, max_seq_len 16: a table is 5 pages wide."""

import ast
from pathlib import Path

import numpy as np
import pytest

from tx.sampling.kv_cache import KVCacheManager, RowPages, min_pool_pages, pool_pages, table_width
from tx.sampling.paged_rows import Live

TOKENS = np.arange(100, 120, dtype=np.int32)


def live(pages: RowPages, pos: int, last: int) -> Live:
    return Live(None, None, pages.table, pages.own, pos, 0, last, pages.copy)


def test_pool_geometry_and_its_floor():
    assert table_width(16, 4) == 5 and table_width(17, 4) == 6 and min_pool_pages(16, 4) == 11
    # 3 slots at 5 pages beside the floor of 11 = 26; 10 bytes per position, 40 per page
    assert pool_pages(3, 16, 4, budget_bytes=10_000, token_bytes=10) == 26
    assert pool_pages(3, 16, 4, budget_bytes=800, token_bytes=10) == 20
    assert pool_pages(3, 16, 4, budget_bytes=100, token_bytes=10) == 11  # never below the floor
    with pytest.raises(ValueError, match="kv_cache_pages=10 is below 11: the pool must hold one longest prompt"):
        KVCacheManager(10, 4, 16, prefix_cache=True)
    kv = KVCacheManager(11, 4, 16, prefix_cache=True)
    assert (kv.num_pages, kv.table_width, kv.pages_in_use, kv.pages_available) == (11, 5, 0, 10)


def test_admission_counts_the_prompt_its_first_call_and_the_live_rows_growth():
    kv = KVCacheManager(11, 4, 16, prefix_cache=True)
    # 9 prompt positions: 3 pages; its row's first call of 4 steps writes positions 9..12: pages 2 and 3 of
    # its table (its copy of the partial page 2, and one more)
    assert kv.can_admit(9, [], last=14, live=[], steps=4)
    prompt = kv.allocate(9, [])
    assert prompt == [1, 2, 3] and kv.pages_in_use == 3
    row = kv.allocate_row(prompt, 9, last=14, steps=1)  # one step: position 9 only, in its copy of page 3
    assert row == RowPages([1, 2, 4], [4], (3, 4)) and kv.pages_available == 6
    lv = live(row, pos=9, last=14)
    # 13 positions: 4 pages + 1 for its first call (13..15) + 1 for lv's next call (9..12) = the 6 available
    assert kv.can_admit(13, [], last=15, live=[lv], steps=4)
    extra = kv.allocate(1, [])
    assert extra == [5] and kv.pages_available == 5
    assert not kv.can_admit(13, [], last=15, live=[lv], steps=4)
    assert kv.can_admit(13, [], last=15, live=[], steps=4)  # lv's growth is what no longer fits
    with pytest.raises(RuntimeError, match="ask can_admit first"):
        kv.allocate(40, [])
    assert kv.pages_available == 5  # the refused allocation took nothing
    kv.free(extra)
    assert kv.can_grow([lv], 4) and kv.grow(lv, 4)
    assert lv.table == [1, 2, 4, 5] and lv.own == [4, 5] and kv.pages_in_use == 5  # page 5 reused (LIFO)
    assert kv.grow(lv, 4) and lv.table == [1, 2, 4, 5]  # holds its next call's pages already: nothing new


def test_a_short_pool_refuses_rows_and_growth_without_change():
    kv = KVCacheManager(11, 4, 16, prefix_cache=True)
    prompt = kv.allocate(4, [])  # one full page: the row starts on a fresh page, no copy
    lv = live(kv.allocate_row(prompt, 4, last=15, steps=4), pos=4, last=15)
    assert (lv.table, lv.own, lv.copy) == ([1, 2], [2], None)
    hog = kv.allocate(32, [])  # the other 8 pages
    assert len(hog) == 8 and kv.pages_available == 0
    assert kv.can_grow([lv], 4)  # positions 4..7: in its page 2 already
    assert not kv.can_grow([lv], 8) and not kv.grow(lv, 8) and lv.table == [1, 2]  # 8..11: one page more
    assert not kv.can_allocate_row(4, last=15, steps=1)
    assert kv.allocate_row(prompt, 4, last=15, steps=1) is None and kv.pages_in_use == 10
    kv.free(hog[:1])
    assert kv.can_allocate_row(4, last=15, steps=4) and not kv.can_allocate_row(5, last=15, steps=4)  # 5..8: 2
    kv.free(hog[1:])
    assert kv.pages_available == 8 and kv.grow(lv, 12) and lv.table == [1, 2, 10, 9]  # positions 8..11, 12..15


def test_a_request_alone_always_fits_the_smallest_pool():
    """The invariant the scheduler relies on when no row decodes (it then releases every other request): with
    nothing else held, any prompt and its first row's first call fit the smallest pool, in at most a table's
    width. Prompt + max_tokens <= max_seq_len 16, so a row's prompt positions and its last written position
    are at most 14 (a resumed row's prompt holds its tokens so far)."""
    kv = KVCacheManager(min_pool_pages(16, 4), 4, 16, prefix_cache=True)
    for prompt_len in range(15):
        for last in range(prompt_len, 15):
            for steps in (1, 3, 4, 16):
                assert kv.can_admit(prompt_len, [], last, [], steps) and kv.pages_in_use == 0
                prompt = kv.allocate(prompt_len, [])
                assert kv.can_allocate_row(prompt_len, last, steps)
                row = kv.allocate_row(prompt, prompt_len, last, steps)
                assert len(set(prompt) | set(row.table)) <= kv.table_width, (prompt_len, last, steps)
                kv.free(prompt)
                kv.free(row.own)


def test_a_published_prefix_is_found_shared_and_held_by_its_readers():
    kv = KVCacheManager(11, 4, 16, prefix_cache=True)
    prompt = kv.allocate(9, [])
    kv.publish("w", TOKENS[:9], prompt)  # 2 full pages; the partial third is never published
    kv.free(prompt)
    assert kv.pages_in_use == 0 and kv.pages_available == 10  # cached pages count as available
    hits = kv.lookup("w", TOKENS[:9])
    assert hits == [1, 2] and kv.cached_tokens(hits) == 8 and kv.pages_in_use == 2
    other = kv.lookup("w", np.r_[TOKENS[:8], 7, 7])  # another prompt with the same first 8 tokens
    assert other == [1, 2] and [kv.pool.refcount(p) for p in (1, 2)] == [2, 2]
    assert kv.lookup("v", TOKENS[:9]) == [] and kv.lookup(None, TOKENS[:9]) == []  # other weights, unshared
    # the prompt with its cached prefix: 3 pages - 2 cached + 2 for the first call = 3 of the 8 left
    assert kv.can_admit(9, hits, last=14, live=[], steps=4)
    pages = kv.allocate(9, hits)
    assert pages == [1, 2, 3] and kv.pages_in_use == 3  # the cached pages themselves, then freed page 3
    kv.free(other)
    row = kv.allocate_row(pages, 9, last=14, steps=4)
    assert row == RowPages([1, 2, 4, 5], [4, 5], (3, 4))
    assert [kv.pool.refcount(p) for p in (1, 2, 3, 4, 5)] == [1] * 5  # the prompt holds what its rows read
    kv.free(row.own)
    kv.free(pages)
    assert kv.pages_in_use == 0 and kv.pool.is_cached(1) and not kv.pool.is_cached(3)
    off = KVCacheManager(11, 4, 16, prefix_cache=False)
    first = off.allocate(9, [])
    off.publish("w", TOKENS[:9], first)
    off.free(first)
    assert off.lookup("w", TOKENS[:9]) == [] and not off.pool.is_cached(1)


def test_pressure_evicts_the_least_recently_used_cached_pages():
    kv = KVCacheManager(11, 4, 16, prefix_cache=True)
    a = kv.allocate(16, [])
    kv.publish("w", TOKENS[:16], a)  # 4 full pages
    kv.free(a)  # cached, least recently used first: 1, 2, 3, 4
    kv.free(kv.lookup("w", TOKENS[:8]))  # pages 1 and 2 read again: now 3, 4, 1, 2
    assert kv.pages_available == 10
    b = kv.allocate(28, [])  # 7 pages: the 6 free ones, then page 3 evicted
    assert sorted(b) == [3, 5, 6, 7, 8, 9, 10] and kv.pool.stats.evicted == 1
    assert kv.lookup("w", TOKENS[:16]) == [1, 2]  # the chain breaks at the evicted third page
    assert kv.pages_in_use == 9 and kv.pages_available == 1  # page 4: cached, its prefix unreachable
    kv.free(b)
    kv.reset()
    assert kv.pages_available == 10 and kv.lookup("w", TOKENS[:16]) == []


def test_the_scheduler_counts_no_pages():
    """continuous.py asks the manager: it names no page size, no page table and no pool counts."""
    source = (Path(__file__).resolve().parents[2] / "tx" / "sampling" / "continuous.py").read_text()
    names = {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    assert not names & {"page", "page_size", "PageTable", "pool", "release", "in_use", "available", "_needed"}
