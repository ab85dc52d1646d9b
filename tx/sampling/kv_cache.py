"""The paged engine's KV-cache manager: every page count the scheduler needs, over the pool and prefix cache of
`kv_pages.PageTable`.

`continuous.PagedEngine` decides which prompts and rows run and when; it asks `KVCacheManager` whether they
fit and for their pages, and never counts pages itself. What a page holds, by position:
- a prompt being prefilled (all of it, `prompt_len` positions) holds ceil(prompt_len /
  page) pages, the first of them possibly found in the prefix cache (`lookup`);
- a row's table is its prompt's full pages (shared, held once by the prompt), then pages only the row holds,
  the first of them its own copy of the prompt's partial last page (copy-on-write);
- a row holds pages up to the position its next call of `steps` decode steps writes (at most its `last`).
A call of `steps` steps by a row at position `pos` writes positions `pos .. min(pos + steps - 1, last)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from tx.sampling.kv_pages import PageTable

if TYPE_CHECKING:
    import numpy as np

    from tx.sampling.paged_rows import Live


def table_width(max_seq_len: int, page: int) -> int:
    """Pages in a row's table: its context, and one more (a row may start mid-page after a shared prefix)."""
    return -(-max_seq_len // page) + 1


def min_pool_pages(max_seq_len: int, page: int) -> int:
    """The smallest pool: one longest prompt beside one longest row (so the oldest row always progresses),
    and the reserved page 0. Hence the invariant the scheduler relies on: a request's prompt with its first
    row's first call (at most `table_width` pages: prompt and tokens stay within max_seq_len) always fits the
    pool when nothing else holds pages, so releasing everything else always lets one row run."""
    return 2 * table_width(max_seq_len, page) + 1


def pool_pages(slots: int, max_seq_len: int, page: int, budget_bytes: int, token_bytes: int) -> int:
    """Pages for every slot at full length beside the smallest pool, at most what `budget_bytes` hold at
    `token_bytes` of K/V per position, at least the smallest pool."""
    floor = min_pool_pages(max_seq_len, page)
    want = slots * table_width(max_seq_len, page) + floor
    return max(floor, min(want, budget_bytes // (token_bytes * page)))


class RowPages(NamedTuple):
    """A row's pages when it takes a slot (`KVCacheManager.allocate_row`)."""

    table: list[int]  # every page it reads, by position
    own: list[int]  # the pages only it holds (the tail of `table`)
    copy: tuple[int, int] | None  # (prompt's partial last page, the row's copy of it), made by its first call


class KVCacheManager:
    """The page pool, the prefix cache and the page arithmetic of prompts and rows. Page lists it hands out
    are held until given back to `free` (cached prefix pages from `lookup` included)."""

    def __init__(self, num_pages: int, page_size: int, max_seq_len: int, prefix_cache: bool):
        self.num_pages, self.page_size, self.prefix_cache = num_pages, page_size, prefix_cache
        self.table_width = table_width(max_seq_len, page_size)
        floor = min_pool_pages(max_seq_len, page_size)
        if num_pages < floor:
            raise ValueError(f"kv_cache_pages={num_pages} is below {floor}: the pool must hold one longest prompt "
                             f"and one longest row (max_seq_len={max_seq_len}, kv_page_size={page_size})")
        self.reset()

    def reset(self) -> None:
        """Every page free, the prefix cache empty."""
        self.pool = PageTable(self.num_pages, self.page_size)

    # ---- counts ----

    @property
    def pages_in_use(self) -> int:
        """Pages some prompt or row holds."""
        return self.pool.in_use

    @property
    def pages_available(self) -> int:
        """Pages an allocation can take now: free ones and cached ones nobody holds (evicted LRU-first)."""
        return self.pool.available

    def cached_tokens(self, cached: Sequence[int]) -> int:
        """Positions the cached prefix pages `cached` (from `lookup`) hold."""
        return len(cached) * self.page_size

    # ---- prompts ----

    def lookup(self, identity: str | None, tokens: Sequence[int]) -> list[int]:
        """The cached pages holding the longest whole-page prefix of `tokens` under the weights `identity`,
        each held once for the caller (give them to `allocate`, or back to `free`)."""
        return self.pool.lookup(identity, tokens) if self._caching(identity) else []

    def can_admit(self, prompt_len: int, cached: Sequence[int], last: int, live: Sequence[Live], steps: int) -> bool:
        """Whether the pool has room for a prompt of `prompt_len` positions beyond its `cached` prefix pages,
        its first row's first call of `steps` steps (that row writes at most up to position `last`) and the
        next call of the `live` rows."""
        need = self._pages(prompt_len) - len(cached) + self._window(prompt_len, last, prompt_len, steps)
        return self.pool.available >= need + self._growth(live, steps)

    def allocate(self, prompt_len: int, cached: Sequence[int]) -> list[int]:
        """The pages of a prompt of `prompt_len` positions: its `cached` prefix pages, then fresh ones (after
        `can_admit`)."""
        fresh = self.pool.allocate(self._pages(prompt_len) - len(cached))
        if fresh is None:
            raise RuntimeError(f"no room for a prompt of {prompt_len} positions: ask can_admit first")
        return list(cached) + fresh

    def publish(self, identity: str | None, tokens: np.ndarray, pages: Sequence[int]) -> None:
        """Offer the full pages of `tokens` (whose K/V `pages` hold, in order) to the prefix cache under the
        weights `identity` (None: K/V no other request may read)."""
        if self._caching(identity):
            self.pool.publish(identity, tokens.tolist(), pages)

    def forget(self, identities: set[str]) -> int:
        """Drop the cached pages published under `identities` (`PageTable.forget`); how many."""
        return self.pool.forget(identities)

    def free(self, pages: Sequence[int]) -> None:
        """Drop the caller's hold on `pages`: a page nobody holds stays cached if published, else is free."""
        self.pool.release(pages)

    # ---- rows ----

    def allocate_row(self, prompt_pages: Sequence[int], prompt_len: int, last: int, steps: int) -> RowPages | None:
        """The pages of a row of a prompt (`prompt_pages`, `prompt_len` positions) taking a slot: its table
        for its first call of `steps` steps, writing at most up to position `last`. None (no change) when the
        pool is short."""
        own = self.pool.allocate(self._window(prompt_len, last, prompt_len, steps))
        if own is None:
            return None
        full = prompt_len // self.page_size
        copy = (prompt_pages[full], own[0]) if prompt_len % self.page_size else None
        return RowPages(list(prompt_pages[:full]) + own, own, copy)

    def can_allocate_row(self, prompt_len: int, last: int, steps: int) -> bool:
        """Whether `allocate_row` of a row of a prompt of `prompt_len` positions (its first call of `steps`
        steps writing at most up to position `last`) finds room."""
        return self.pool.available >= self._window(prompt_len, last, prompt_len, steps)

    def can_grow(self, live: Sequence[Live], steps: int) -> bool:
        """Whether the pool has room for the next call of `steps` steps of every row of `live`."""
        return self.pool.available >= self._growth(live, steps)

    def grow(self, lv: Live, steps: int) -> bool:
        """Give `lv` (in its table and own pages) the pages its next call of `steps` steps writes; False (no
        change) when the pool is short."""
        n = self._needed(lv, steps)
        if n <= 0:
            return True
        new = self.pool.allocate(n)
        if new is None:
            return False
        lv.own += new
        lv.table += new
        return True

    # ---- arithmetic ----

    def _pages(self, positions: int) -> int:
        return -(-positions // self.page_size)

    def _window(self, pos: int, last: int, start: int, steps: int) -> int:
        """Pages covering positions `start` .. min(pos + steps - 1, last) (a call's writes)."""
        return min(pos + steps - 1, last) // self.page_size - start // self.page_size + 1

    def _needed(self, lv: Live, steps: int) -> int:
        """Pages `lv`'s next call writes beyond those it holds (<= 0: none)."""
        return min(lv.pos + steps - 1, lv.last) // self.page_size + 1 - len(lv.table)

    def _growth(self, live: Sequence[Live], steps: int) -> int:
        return sum(max(0, self._needed(lv, steps)) for lv in live)

    def _caching(self, identity: str | None) -> bool:
        return self.prefix_cache and identity is not None
