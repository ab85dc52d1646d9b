"""Host bookkeeping of the paged KV cache: which pages are free, who holds them, and the prefix cache.

The device holds the pools (`tx.kernels.paged_attention`); this module decides which page ids a sequence
writes and reads. It is pure Python and deterministic (no wall clock, no salted `hash()`), so every host
of a multi-host run, fed the same calls, makes the same decisions.

- A page is **free**, **held** (refcount > 0: in some sequence's table), or **cached** (refcount 0 but its
  K/V is kept under a prefix hash for reuse; evicted least-recently-used when pages run short).
- **Prefix cache**: a full page of tokens is keyed by a chained blake2b hash
  `h_j = blake2b(h_{j-1} || tokens of page j)`, with `h_-1` derived from an identity of the weights that
  produced the K/V (base model, adapter slot and its version: LoRA changes K/V). `lookup` returns the
  longest run of cached pages that starts the token sequence; `publish` records a sequence's full pages
  once their K/V is written.
- Sharing: `retain` adds a holder to pages (the `num_samples` rows of one prompt share its pages);
  `release` drops one. The last holder of a published page leaves it cached; of any other page, frees it.
Page `TRASH_PAGE` (0) is never handed out.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tx.kernels.paged_attention import TRASH_PAGE


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def page_hashes(identity: str, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """The chained hash of each full page of `tokens` under the weights `identity`."""
    out, h = [], _digest(identity.encode())
    for j in range(len(tokens) // page_size):
        chunk = b"".join(int(t).to_bytes(4, "little", signed=False) for t in tokens[j * page_size:(j + 1) * page_size])
        h = _digest(h + chunk)
        out.append(h)
    return out


@dataclass
class PageStats:
    allocated: int = 0
    peak_in_use: int = 0
    evicted: int = 0
    lookups: int = 0
    hit_pages: int = 0


@dataclass
class PageTable:
    """Host state of the pages: free list, holders per page, and the prefix cache."""

    num_pages: int
    page_size: int
    stats: PageStats = field(default_factory=PageStats)

    def __post_init__(self):
        if self.num_pages < 2:
            raise ValueError(f"kv_cache_pages={self.num_pages}: need at least 2 (page 0 is reserved)")
        if self.page_size < 1:
            raise ValueError(f"kv_page_size={self.page_size} must be >= 1")
        self._free = list(range(self.num_pages - 1, TRASH_PAGE, -1))  # pop() hands out 1, 2, 3, ...
        self._refs = [0] * self.num_pages
        self._held = 0
        self._hash_of: dict[int, bytes] = {}  # cached page -> its prefix hash
        self._page_of: dict[bytes, int] = {}  # prefix hash -> page
        self._identity_of: dict[int, str] = {}  # cached page -> the weights identity it was published under
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, LRU first

    # ---- counts ----

    @property
    def in_use(self) -> int:
        """Pages held by some sequence."""
        return self._held

    @property
    def available(self) -> int:
        """Pages `allocate` can hand out now: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def is_cached(self, page: int) -> bool:
        return page in self._hash_of

    # ---- holding pages ----

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh pages (refcount 1), evicting unheld cached pages LRU-first if the free list runs out;
        None (and no change) if fewer than `n` are available."""
        if n > self.available:
            return None
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._uncache(page)
                self.stats.evicted += 1
            self._refs[page] = 1
            self._held += 1
            pages.append(page)
        self.stats.allocated += n
        self.stats.peak_in_use = max(self.stats.peak_in_use, self.in_use)
        return pages

    def retain(self, pages: Sequence[int]) -> None:
        """One more holder of each page (a cached page stops being evictable)."""
        for page in pages:
            self._check(page)
            if self._refs[page] == 0:
                if page not in self._evictable:
                    raise ValueError(f"page {page} is free: allocate it first")
                del self._evictable[page]
                self._held += 1
            self._refs[page] += 1
        self.stats.peak_in_use = max(self.stats.peak_in_use, self.in_use)

    def release(self, pages: Sequence[int]) -> None:
        """One holder fewer; a page nobody holds is kept for reuse if published, else freed."""
        for page in pages:
            self._check(page)
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} is not held")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._held -= 1
                if page in self._hash_of:
                    self._evictable[page] = None  # most recently used last
                else:
                    self._free.append(page)

    def _check(self, page: int) -> None:
        if not TRASH_PAGE < page < self.num_pages:
            raise ValueError(f"page {page} is not a page of this pool (1..{self.num_pages - 1})")

    # ---- prefix cache ----

    def lookup(self, identity: str, tokens: Sequence[int], max_pages: int | None = None) -> list[int]:
        """The cached pages holding the longest prefix of `tokens` (whole pages, at most `max_pages`), each
        retained once for the caller."""
        self.stats.lookups += 1
        hits = []
        for h in page_hashes(identity, tokens, self.page_size)[:max_pages]:
            page = self._page_of.get(h)
            if page is None:
                break
            hits.append(page)
        self.retain(hits)  # held pages are not evictable; released, they rejoin the LRU as most recent
        self.stats.hit_pages += len(hits)
        return hits

    def publish(self, identity: str, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Record the full pages of `tokens` (whose K/V `pages` hold, in order) in the prefix cache. A page
        whose prefix is already cached elsewhere stays uncached (the first copy wins). Returns how many
        pages were added."""
        added = 0
        for h, page in zip(page_hashes(identity, tokens, self.page_size), pages):
            self._check(page)
            if h in self._page_of or page in self._hash_of:
                continue
            self._page_of[h] = page
            self._hash_of[page] = h
            self._identity_of[page] = identity
            if self._refs[page] == 0:
                self._evictable[page] = None
            added += 1
        return added

    def forget(self, identities: set[str] | None = None) -> int:
        """Drop the cached prefixes published under `identities` (weights no request will name again), or
        every one (None: weights changed in a way the identities do not capture). The pages nobody holds are
        free again and handed out before any page never used (on CPU a pool page costs memory once written).
        Returns how many pages were dropped from the cache."""
        dropped = [p for p, ident in self._identity_of.items() if identities is None or ident in identities]
        for page in dropped:
            self._uncache(page)
            if page in self._evictable:
                del self._evictable[page]
                self._free.append(page)
        return len(dropped)

    def _uncache(self, page: int) -> None:
        del self._page_of[self._hash_of.pop(page)]
        del self._identity_of[page]
