"""Decode attention reading shared pages once per segment of rows (tx/kernels/shared_prefix.py), with the
segments planned by the host (tx/sampling/prefix_segments.py), against numpy attention over each row's
unpaged keys and values, and against the same kernel without the shared read: bit for bit, since a row's
products and softmax updates are the row-by-row read's own."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.kernels.test_paged_attention import numpy_attention, unpaged
from tx.kernels import paged_blocks
from tx.kernels.paged_attention import blocked_paged_attention, paged_attention
from tx.kernels.shared_prefix import SharedPrefix
from tx.sampling.prefix_segments import plan_segments

LAYERS, PAGES, PAGE, KV, H, D, KV_BLOCK = 2, 64, 4, 2, 6, 8, 8


def grouped_case(seed, groups, singles, width=12):
    """Rows of `groups` (per group: its shared pages and each member's position) and `singles` (positions),
    shuffled over the slots; shared pages are common to a group's rows, every other page a row's own."""
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(np.arange(1, PAGES)))
    rows = []  # (table, position)
    for shared, positions in groups:
        pages = [free.pop() for _ in range(shared)]
        for p in positions:
            rows.append((pages + [free.pop() for _ in range(p // PAGE + 1 - shared)], p))
    for p in singles:
        rows.append(([free.pop() for _ in range(p // PAGE + 1)], p))
    perm = rng.permutation(len(rows))
    rows = [rows[i] for i in perm]
    table = np.zeros((len(rows), width), np.int32)
    for b, (pages, _) in enumerate(rows):
        table[b, : len(pages)] = pages
    q_pos = np.array([[p] for _, p in rows], np.int32)
    k_pool = rng.standard_normal((LAYERS, PAGES, PAGE, KV, D)).astype(np.float32)
    v_pool = rng.standard_normal((LAYERS, PAGES, PAGE, KV, D)).astype(np.float32)
    q = rng.standard_normal((len(rows), 1, H, D)).astype(np.float32)
    return q, k_pool, v_pool, table, q_pos, [pages for pages, _ in rows]


def as_prefix(plan):
    return SharedPrefix(*(jnp.asarray(plan[k]) for k in ("order_s", "place_s", "table_nw", "len_s")))


@pytest.mark.parametrize("row_group", [None, 8])
@pytest.mark.parametrize("products", ["dot", "reduce"])
def test_shared_read_matches_numpy_and_the_row_by_row_read(products, row_group, monkeypatch):
    """32 slots (8 segments of 4): a group of 5 rows (3 shared pages = 12 keys: one 8-key block shared), a
    group of 3 with 6 shared pages (24 keys, 3 blocks), 2 rows alone, 22 empty slots; rows shuffled over the
    slots, so a segment's rows are not neighbours. `row_group` 8: the rows run in 4 groups (CPU's row groups,
    `paged_blocks.DECODE_ROW_GROUP`), the segments in 4 groups of 2, each group's loops as long as its own."""
    monkeypatch.setattr(paged_blocks, "DECODE_ROW_GROUP", row_group)
    groups = [(3, [13, 17, 22, 12, 30]), (6, [25, 26, 40])]
    q, k_pool, v_pool, table, q_pos, tables = grouped_case(0, groups, singles=[9, 21])
    slots = 32
    pad = slots - len(tables)
    q, table, q_pos = (np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]) for x in (q, table, q_pos))
    plan = plan_segments(tables, [int(p) for p in q_pos[: len(tables), 0]], slots, 1, table.shape[1], PAGE, KV_BLOCK)
    assert sorted(plan["len_s"][: len(tables)].tolist()) == [0, 0] + [8] * 5 + [24] * 3
    assert plan["table_nw"].shape[0] == 8
    args = (jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool))
    for layer in range(LAYERS):
        shared = blocked_paged_attention(*args, layer, jnp.asarray(table), jnp.asarray(q_pos), 0.3, KV_BLOCK,
                                         platform="cpu", products=products, prefix=as_prefix(plan))
        own = blocked_paged_attention(*args, layer, jnp.asarray(table), jnp.asarray(q_pos), 0.3, KV_BLOCK,
                                      platform="cpu", products=products)
        for b in range(len(tables)):
            n = int(q_pos[b, 0]) + 1
            want = numpy_attention(q[b].astype(np.float64), unpaged(k_pool, layer, table[b], n),
                                   unpaged(v_pool, layer, table[b], n), q_pos[b], 0.3)
            np.testing.assert_allclose(np.asarray(shared[b]), want, atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(shared[: len(tables)]), np.asarray(own[: len(tables)]))


@pytest.mark.parametrize("seed", [4, 5])
def test_a_rows_bits_do_not_depend_on_its_segment_or_how_much_it_shares(seed):
    """One group of 6 rows (5 shared pages: 16 keys in 2 whole blocks) read four ways: as planned (3 segments
    of 2 rows), in 2 segments of 3 shuffled rows, with only some rows sharing (`len_s` 0 for three, 8 for
    one), and row by row: each row's output is the same bits every time."""
    q, k_pool, v_pool, table, q_pos, tables = grouped_case(seed, [(5, [24, 29, 21, 35, 22, 27])], singles=[])
    args = (jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), 1, jnp.asarray(table), jnp.asarray(q_pos),
            0.3, KV_BLOCK)
    one = plan_segments(tables, q_pos[:, 0].tolist(), 6, 1, table.shape[1], PAGE, KV_BLOCK)
    assert sorted(one["len_s"].tolist()) == [16] * 6 and one["table_nw"].shape[0] == 3  # segments of 2 rows
    rng = np.random.default_rng(seed)
    order = rng.permutation(6).astype(np.int32)
    split = dict(order_s=order, place_s=np.argsort(order).astype(np.int32), len_s=np.full(6, 16, np.int32),
                 table_nw=np.repeat(one["table_nw"], 2, axis=0))  # two segments of 3 rows, rows shuffled
    some = dict(one, len_s=np.array([16, 0, 8, 0, 16, 0], np.int32))
    outs = [np.asarray(blocked_paged_attention(*args, products="reduce", prefix=as_prefix(plan)))
            for plan in (one, split, some)]
    outs.append(np.asarray(blocked_paged_attention(*args, products="reduce")))
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_no_shared_pages_is_the_row_by_row_read_exactly():
    """Every `len_s` 0 (rows that share nothing): the shared read leaves the state at its start, and each row's
    own loop starts at block 0: bit-identical to the read without it."""
    q, k_pool, v_pool, table, q_pos, tables = grouped_case(1, [], singles=[5, 19, 30, 11])
    plan = plan_segments(tables, q_pos[:, 0].tolist(), 4, 1, table.shape[1], PAGE, KV_BLOCK)
    assert not plan["len_s"].any()
    args = (jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), 1, jnp.asarray(table), jnp.asarray(q_pos),
            0.3, KV_BLOCK)
    np.testing.assert_array_equal(np.asarray(blocked_paged_attention(*args, prefix=as_prefix(plan))),
                                  np.asarray(blocked_paged_attention(*args)))


def test_a_static_block_count_with_shared_pages_matches():
    """`kv_blocks` static (a loop of known count past every row's blocks): each row's own blocks start after its
    shared ones, and the blocks past its table are masked."""
    q, k_pool, v_pool, table, q_pos, tables = grouped_case(2, [(4, [20, 33, 18, 27])], singles=[])
    plan = plan_segments(tables, q_pos[:, 0].tolist(), 4, 1, table.shape[1], PAGE, KV_BLOCK)
    args = (jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), 0, jnp.asarray(table), jnp.asarray(q_pos),
            0.3, KV_BLOCK)
    dynamic = blocked_paged_attention(*args)
    static = blocked_paged_attention(*args, kv_blocks=8, prefix=as_prefix(plan))
    np.testing.assert_array_equal(np.asarray(static), np.asarray(dynamic))


def test_a_shared_read_is_refused_where_it_does_not_apply():
    q, k_pool, v_pool, table, q_pos, tables = grouped_case(3, [(2, [10, 12])], singles=[])
    prefix = as_prefix(plan_segments(tables, q_pos[:, 0].tolist(), 2, 1, table.shape[1], PAGE, KV_BLOCK))
    q, k_pool, v_pool, table, q_pos = (jnp.asarray(x) for x in (q, k_pool, v_pool, table, q_pos))
    with pytest.raises(ValueError, match="'blocked' only, not 'reference'"):
        paged_attention(q, k_pool, v_pool, 0, table, q_pos, 0.3, impl="reference", prefix=prefix)
    with pytest.raises(ValueError, match="not by 2 queries a row"):
        blocked_paged_attention(jnp.concatenate([q, q], axis=1), k_pool, v_pool, 0, table,
                                jnp.concatenate([q_pos - 1, q_pos], axis=1), 0.3, KV_BLOCK, prefix=prefix)
