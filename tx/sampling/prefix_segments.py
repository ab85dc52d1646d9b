"""Which decode rows read which shared pages (`tx.kernels.shared_prefix.SharedPrefix`), planned on the host.

Rows whose page tables start with the same pages (the samples of one prompt; prompts the prefix cache shares)
form segments of up to `c` rows (`segment_rows`; a larger group splits into as few even segments as hold it);
a segment's pages are the longest run of table entries all its rows hold in common, cut to whole attention
blocks and to the rows' positions. A page id shared by two tables holds the same keys and values for both:
rows write only pages they hold alone (copy-on-write of a prompt's partial page). Rows in no segment fill the
remaining places with nothing to read there (`len_s` 0). A device caps its segments' blocks where reading them
all would lengthen its loops (`_shared_cap`; 0: no segment, as where a row that shares nothing reaches
furthest): a row's results are the same bits however much of it is read shared, so the cap is about time only.
Where the batch is split over devices, each device's rows form their own segments and every index is local to
the device. Pure Python over the tables, deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# rows per segment: RL's groups are of 4-64 samples. A segment's block is gathered once for its rows, whose
# products are each their own, so 4 gathers a 16-row group's block 4 times and is as fast as 16 at 512 rows
# (docs/performance.md), while groups of 4-8 then hold a place each (a call of s slots has s / 4)
SHARED_PREFIX_ROWS = 4


def segment_rows(slots: int, shards: int, most: int = SHARED_PREFIX_ROWS) -> int:
    """Rows per segment in a call of `slots` slots split over `shards` devices: `most` (a power of two), or
    the largest power of two that divides a device's slots."""
    local, c = slots // shards, most
    while local % c:
        c //= 2
    return c


def _common_pages(tables: list[Sequence[int]]) -> int:
    n = min(len(t) for t in tables)
    for i in range(n):
        if any(t[i] != tables[0][i] for t in tables[1:]):
            return i
    return n


def _shared_cap(segments: list, positions: dict[int, int], kv_block: int) -> int:
    """The most blocks a segment reads shared: the cap that runs the fewest blocks in all, the largest such
    (the most keys gathered once). The shared loop runs as many blocks as the longest (capped) segment spans,
    for all of a device's rows, then every row's own loop as many as the row furthest past its shared keys
    (all the blocks of a row that shares nothing); cap 0, no segment, runs what the furthest row needs."""
    own = {j: pos // kv_block + 1 for j, pos in positions.items()}
    shared = {j: tokens // kv_block for chunk, _, tokens in segments for j in chunk}

    def blocks(cap: int) -> int:
        return min(cap, max(shared.values())) + max(n - min(shared.get(j, 0), cap) for j, n in own.items())

    return min(sorted(set(shared.values()) | {0}, reverse=True), key=blocks)


def plan_segments(tables: Sequence[Sequence[int] | None], positions: Sequence[int], slots: int, shards: int,
                  width: int, page: int, kv_block: int, most: int = SHARED_PREFIX_ROWS) -> dict[str, np.ndarray]:
    """The `SharedPrefix` arrays of a decode call: row `j` (slot `j`) has page table `tables[j]` (None: the
    slot runs no row) and its next input at `positions[j]`. Returns `order_s`, `place_s`, `len_s` (int32
    `[slots]`) and `table_nw` (int32 `[slots // c, width]`), with segments of `c = segment_rows(slots,
    shards, most)` rows."""
    c = segment_rows(slots, shards, most)
    local = slots // shards
    order_s, place_s = np.zeros(slots, np.int32), np.zeros(slots, np.int32)
    len_s = np.zeros(slots, np.int32)
    table_nw = np.zeros((slots // c, width), np.int32)
    for shard in range(shards):
        first = shard * local
        rows = [j for j in range(first, min(first + local, len(tables))) if tables[j]]
        by_start: dict[int, list[int]] = {}
        for j in rows:
            by_start.setdefault(tables[j][0], []).append(j)
        segments = []  # (rows, pages, tokens)
        for members in by_start.values():
            k = -(-len(members) // c)  # as few segments as hold them, as even as can be (no row left alone)
            for chunk in (members[i * len(members) // k:(i + 1) * len(members) // k] for i in range(k)):
                if len(chunk) < 2:
                    continue
                pages = _common_pages([tables[j] for j in chunk])
                tokens = min(pages * page, min(positions[j] for j in chunk)) // kv_block * kv_block
                if tokens:
                    segments.append((chunk, tables[chunk[0]][:tokens // page], tokens))
        # the most keys saved first, where there are more segments than places
        segments.sort(key=lambda seg: -len(seg[0]) * seg[2])
        segments = segments[: local // c]
        cap = _shared_cap(segments, {j: positions[j] for j in rows}, kv_block) * kv_block if segments else 0
        segments = [(chunk, pages[: min(tokens, cap) // page], min(tokens, cap)) for chunk, pages, tokens in segments
                    if cap]
        placed = [None] * local  # place -> local row
        for k, (chunk, pages, tokens) in enumerate(segments):
            table_nw[first // c + k, : len(pages)] = pages
            for i, j in enumerate(chunk):
                placed[k * c + i] = j - first
                len_s[j] = tokens
        rest = iter(sorted(set(range(local)) - {r for r in placed if r is not None}))
        for p in range(local):
            if placed[p] is None:
                placed[p] = next(rest)
        order_s[first:first + local] = placed
        place_s[first:first + local] = np.argsort(placed)
    return {"order_s": order_s, "place_s": place_s, "table_nw": table_nw, "len_s": len_s}
