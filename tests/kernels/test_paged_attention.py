"""Paged attention against numpy attention over each sequence's unpaged K/V, page writes, and the blocked
and Pallas kernels' batch invariance (a row's output is bit-identical whatever the other rows and the table
width). The Pallas kernel runs in interpret mode on CPU."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from tx.kernels import paged_blocks
from tx.kernels.paged_attention import (TRASH_PAGE, blocked_paged_attention, decode_products, paged_attention,
                                        token_slots, write_kv_pages)
from tx.kernels.paged_blocks import decode_row_groups
from tx.kernels.paged_pallas import pallas_paged_attention

L, PAGES, P, KV, H, D = 2, 40, 4, 2, 4, 8


def numpy_attention(q_thd, k_skd, v_skd, q_pos_t, scale):
    """float64 softmax attention of each query over keys 0..q_pos (GQA: query head i reads kv head i // g)."""
    g = q_thd.shape[1] // k_skd.shape[1]
    out = np.zeros(q_thd.shape)
    for t, p in enumerate(q_pos_t):
        for h in range(q_thd.shape[1]):
            s = k_skd[: p + 1, h // g] @ q_thd[t, h] * scale
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v_skd[: p + 1, h // g]
    return out


def make_case(seed, lengths, t, width=None, dtype=jnp.float32):
    """Pools holding random K/V of sequences of `lengths` (every page distinct, shuffled), their tables,
    and queries at the last `t` positions of each sequence."""
    rng = np.random.default_rng(seed)
    k_pool = rng.standard_normal((L, PAGES, P, KV, D))
    v_pool = rng.standard_normal((L, PAGES, P, KV, D))
    width = width or max(-(-n // P) for n in lengths)
    free = list(rng.permutation(np.arange(1, PAGES)))
    table = np.zeros((len(lengths), width), np.int32)
    for b, n in enumerate(lengths):
        for j in range(-(-n // P)):
            table[b, j] = free.pop()
    q = rng.standard_normal((len(lengths), t, H, D))
    q_pos = np.stack([np.arange(n - t, n) for n in lengths]).astype(np.int32)
    return (jnp.asarray(q, dtype), jnp.asarray(k_pool, dtype), jnp.asarray(v_pool, dtype), jnp.asarray(table),
            jnp.asarray(q_pos))


def unpaged(pool, layer, table_row, n):
    pool = np.asarray(pool, np.float64)
    return np.concatenate([pool[layer, p] for p in table_row])[:n]


@pytest.mark.parametrize("impl,kv_block", [("reference", 0), ("blocked", 4), ("blocked", 8), ("pallas", 4),
                                           ("pallas", 8)])
@pytest.mark.parametrize("t", [1, 3])
def test_matches_numpy_attention(impl, kv_block, t):
    """GQA (2 query heads per kv head), shuffled pages, ragged lengths, a table 7 pages wide (row 1's is
    padded with the trash page after its one page), decode (t=1) and a prefill chunk (t=3)."""
    lengths = [13, 3, 22]
    q, k_pool, v_pool, table, q_pos = make_case(0, lengths, t, width=7)
    scale = D ** -0.5
    for layer in range(L):
        out = paged_attention(q, k_pool, v_pool, layer, table, q_pos, scale, impl=impl, kv_block=kv_block)
        for b, n in enumerate(lengths):
            want = numpy_attention(np.asarray(q[b], np.float64), unpaged(k_pool, layer, table[b], n),
                                   unpaged(v_pool, layer, table[b], n), np.asarray(q_pos[b]), scale)
            np.testing.assert_allclose(np.asarray(out[b]), want, atol=1e-5, rtol=1e-5)


def test_decode_products_are_chosen_by_rows_and_platform():
    assert [decode_products(rows, "cpu") for rows in (1, 2, 512)] == ["dot", "reduce", "reduce"]
    assert decode_products(8, "cuda") == decode_products(8, "tpu") == "dot"
    q, k_pool, v_pool, table, q_pos = make_case(3, [5], 1)
    with pytest.raises(ValueError, match="products='mul'"):
        blocked_paged_attention(q, k_pool, v_pool, 0, table, q_pos, 1.0, kv_block=4, products="mul")


@pytest.mark.parametrize("products", ["dot", "reduce"])
def test_both_decode_products_match_numpy(products):
    """Decode's two ways of forming a block's products ("reduce": CPU at 2+ rows; "dot": one row, GPUs), each
    against numpy over ragged rows, and a row alone (as `decode_products` picks for one row on CPU) against
    the same row in the batch: float32 rounding apart."""
    lengths = [13, 3, 22]
    q, k_pool, v_pool, table, q_pos = make_case(4, lengths, 1, width=7)
    out = blocked_paged_attention(q, k_pool, v_pool, 1, table, q_pos, 0.3, kv_block=8, products=products)
    for b, n in enumerate(lengths):
        want = numpy_attention(np.asarray(q[b], np.float64), unpaged(k_pool, 1, table[b], n),
                               unpaged(v_pool, 1, table[b], n), np.asarray(q_pos[b]), 0.3)
        np.testing.assert_allclose(np.asarray(out[b]), want, atol=1e-5, rtol=1e-5)
    alone = paged_attention(q[2:], k_pool, v_pool, 1, table[2:], q_pos[2:], 0.3, impl="blocked", kv_block=8,
                            platform="cpu")
    np.testing.assert_allclose(np.asarray(alone[0]), np.asarray(out[2]), atol=1e-6, rtol=1e-6)


def test_decode_rows_run_in_groups_on_cpu(monkeypatch):
    """On CPU, decode attention runs its rows in groups of at most `DECODE_ROW_GROUP` in turn, each group's
    block loop as far as its own furthest row: 16 ragged rows in 4 groups of 4 (one group of 1-block rows,
    one of 2-block rows) give numpy's attention, each group's rows the bits of that group run as a batch of its
    own (found and static block counts), and the program loops over the groups (none where grouping is off)."""
    assert [decode_row_groups(rows, "cpu") for rows in (1, 48, 64, 96, 384, 512)] == [1, 1, 1, 2, 8, 8]
    assert decode_row_groups(512, "cuda") == decode_row_groups(512, "tpu") == 1
    lengths = [3, 1, 4, 2, 8, 7, 5, 6, 2, 8, 3, 4, 1, 1, 1, 1]
    q, k_pool, v_pool, table, q_pos = make_case(6, lengths, 1, width=2)
    monkeypatch.setattr(paged_blocks, "DECODE_ROW_GROUP", 4)
    assert decode_row_groups(16, "cpu") == 4

    def attend(q, table, q_pos, kv_blocks=None):
        return blocked_paged_attention(q, k_pool, v_pool, 1, table, q_pos, 0.3, kv_block=4, kv_blocks=kv_blocks,
                                       platform="cpu", products="reduce")

    for kv_blocks in (None, 2):
        out = attend(q, table, q_pos, kv_blocks)
        for b, n in enumerate(lengths):
            want = numpy_attention(np.asarray(q[b], np.float64), unpaged(k_pool, 1, table[b], n),
                                   unpaged(v_pool, 1, table[b], n), np.asarray(q_pos[b]), 0.3)
            np.testing.assert_allclose(np.asarray(out[b]), want, atol=1e-5, rtol=1e-5)
        for i in range(0, 16, 4):
            alone = attend(q[i:i + 4], table[i:i + 4], q_pos[i:i + 4], kv_blocks)
            np.testing.assert_array_equal(np.asarray(out[i:i + 4]), np.asarray(alone))
    def loops():  # the program's loops: the block loop, inside a loop over the groups when grouped (a new
        # function each time: make_jaxpr caches by function)
        return re.findall(r"= (while|scan)\[", str(jax.make_jaxpr(lambda *a: attend(*a))(q, table, q_pos)))

    assert loops() == ["scan", "while"]
    monkeypatch.setattr(paged_blocks, "DECODE_ROW_GROUP", None)
    assert decode_row_groups(16, "cpu") == 1 and loops() == ["while"]


@pytest.mark.parametrize("impl", ["blocked", "pallas"])
def test_bf16_within_bf16_error(impl):
    lengths = [17, 9]
    q, k_pool, v_pool, table, q_pos = make_case(1, lengths, 1, dtype=jnp.bfloat16)
    out = paged_attention(q, k_pool, v_pool, 1, table, q_pos, 0.3, impl=impl, kv_block=8)
    for b, n in enumerate(lengths):
        want = numpy_attention(np.asarray(q[b], np.float64), unpaged(k_pool, 1, table[b], n),
                               unpaged(v_pool, 1, table[b], n), np.asarray(q_pos[b]), 0.3)
        np.testing.assert_allclose(np.asarray(out[b], np.float64), want, atol=3e-2)


@pytest.mark.parametrize("impl", ["blocked", "pallas"])
def test_rows_are_bit_identical_whatever_the_batch_and_width(impl):
    """Row 0 (10 tokens) alone in a 2-row batch with a short neighbour, then beside a 30-token neighbour
    (three more blocks run) in a table twice as wide: its output does not change by one bit."""
    q, k_pool, v_pool, table, q_pos = make_case(2, [10, 30], 1, width=16)
    fn = jax.jit(paged_attention, static_argnames=("impl", "kv_block", "scale"))
    wide = fn(q, k_pool, v_pool, 0, table, q_pos, scale=0.25, impl=impl, kv_block=4)
    short_q_pos = q_pos.at[1].set(2)  # the neighbour now needs one block only
    narrow = fn(q, k_pool, v_pool, 0, table[:, :8], short_q_pos, scale=0.25, impl=impl, kv_block=4)
    np.testing.assert_array_equal(np.asarray(wide[0]), np.asarray(narrow[0]))


@pytest.mark.parametrize("t", [1, 3])
def test_a_static_block_count_matches_numpy_and_the_device_found_count(t):
    """`kv_blocks` (the host's count, as the engine picks on GPUs): exactly the blocks needed, one more, and
    more blocks than the table spans (it is padded with the trash page) give every row numpy's attention,
    and the same bits as the count the device finds: the extra blocks are fully masked no-ops."""
    lengths = [13, 3, 22]
    q, k_pool, v_pool, table, q_pos = make_case(5, lengths, t, width=6)
    fn = jax.jit(paged_attention, static_argnames=("impl", "kv_block", "scale", "kv_blocks"))
    found = fn(q, k_pool, v_pool, 1, table, q_pos, scale=0.3, impl="blocked", kv_block=4)
    needed = int(q_pos.max()) // 4 + 1  # 6 blocks of 4 tokens; the table spans 6 pages of 4
    for kv_blocks in (needed, needed + 1, needed + 3):
        out = fn(q, k_pool, v_pool, 1, table, q_pos, scale=0.3, impl="blocked", kv_block=4, kv_blocks=kv_blocks)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(found))
        for b, n in enumerate(lengths):
            want = numpy_attention(np.asarray(q[b], np.float64), unpaged(k_pool, 1, table[b], n),
                                   unpaged(v_pool, 1, table[b], n), np.asarray(q_pos[b]), 0.3)
            np.testing.assert_allclose(np.asarray(out[b]), want, atol=1e-5, rtol=1e-5)


def test_a_static_block_count_is_a_loop_of_known_count():
    """The reason for `kv_blocks`: its program has no loop whose trip count depends on data (XLA on a GPU
    runs such a loop by copying its condition to the host at every iteration), while the device-found
    count's program has one."""
    q, k_pool, v_pool, table, q_pos = make_case(6, [9, 5], 1, width=4)

    def whiles(**kw) -> list[str]:
        fn = jax.jit(partial(paged_attention, scale=0.3, impl="blocked", kv_block=4, **kw))
        hlo = fn.lower(q, k_pool, v_pool, 0, table, q_pos).compile().as_text()
        return [line for line in hlo.splitlines() if " while(" in line]

    assert any("known_trip_count" not in w for w in whiles())
    # every loop left (XLA may also unroll it) runs a count known when compiled
    assert all("known_trip_count" in w for w in whiles(kv_blocks=4)), whiles(kv_blocks=4)


def test_writes_land_in_their_pages_and_padding_in_the_trash_page():
    pool = jnp.zeros((L, PAGES, P, KV, D))
    table = jnp.asarray([[5, 9, 0], [7, 0, 0]], jnp.int32)
    pos = jnp.asarray([[3, 4, 5], [0, 1, 2]], jnp.int32)
    valid = jnp.asarray([[True, True, True], [True, True, False]])
    page, offset = token_slots(table, pos, P, valid)
    np.testing.assert_array_equal(np.asarray(page), [[5, 9, 9], [7, 7, TRASH_PAGE]])
    np.testing.assert_array_equal(np.asarray(offset), [[3, 0, 1], [0, 1, 2]])
    new = jnp.arange(2 * 3 * KV * D, dtype=jnp.float32).reshape(2, 3, KV, D) + 1
    out = np.asarray(jax.jit(write_kv_pages, donate_argnums=0)(pool, 1, new, page, offset))
    np.testing.assert_array_equal(out[1, 5, 3], new[0, 0])
    np.testing.assert_array_equal(out[1, 9, 1], new[0, 2])
    np.testing.assert_array_equal(out[1, 7, 1], new[1, 1])
    assert np.count_nonzero(out[0]) == 0  # other layer untouched
    written = {(5, 3), (9, 0), (9, 1), (7, 0), (7, 1), (TRASH_PAGE, 2)}
    untouched = [(p, o) for p in range(PAGES) for o in range(P) if (p, o) not in written]
    assert all(np.count_nonzero(out[1, p, o]) == 0 for p, o in untouched)


def test_unknown_impl_and_bad_block_are_named():
    q, k_pool, v_pool, table, q_pos = make_case(3, [5], 1)
    with pytest.raises(ValueError, match="paged_attention_impl='nope'"):
        paged_attention(q, k_pool, v_pool, 0, table, q_pos, 1.0, impl="nope")
    with pytest.raises(ValueError, match="kv_block=6 must be a multiple of the page size 4"):
        paged_attention(q, k_pool, v_pool, 0, table, q_pos, 1.0, impl="blocked", kv_block=6)
    with pytest.raises(ValueError, match="kv_block=6 must be a multiple of the page size 4"):
        paged_attention(q, k_pool, v_pool, 0, table, q_pos, 1.0, impl="pallas", kv_block=6)
    with pytest.raises(ValueError, match="kv_heads_per_step=3 must divide num kv heads 2"):
        pallas_paged_attention(q, k_pool, v_pool, 0, table, q_pos, 1.0, 4, kv_heads_per_step=3)


@pytest.mark.parametrize("kv_heads_per_step,interpret", [(None, True), (1, True), (None, "tpu")])
def test_pallas_reads_no_block_past_a_rows_furthest_query(kv_heads_per_step, interpret):
    """Tables of 8 pages (32 tokens) whose pages past each row's last needed block (kv_block 8: two pages)
    hold NaN, as pages allocated ahead for decode may: the Pallas kernel never computes with them. Row 0's
    queries end in block 0, row 1's in block 1; row 2 has one page and a table padded with the trash page.
    One kv head per grid step or both at once; Pallas's generic interpreter, or its TPU interpreter (which
    simulates SMEM/VMEM and the block copies)."""
    if interpret == "tpu":
        interpret = pltpu.InterpretParams()
    q, k_pool, v_pool, table, q_pos = make_case(4, [32, 32, 32], 2, width=8)
    table = table.at[2, 1:].set(TRASH_PAGE)
    q_pos = jnp.asarray([[3, 4], [12, 13], [0, 2]], jnp.int32)
    stale = jnp.concatenate([table[0, 2:], table[1, 4:]])  # blocks 1.. of row 0, blocks 2.. of row 1
    k_pool, v_pool = k_pool.at[:, stale].set(jnp.nan), v_pool.at[:, stale].set(jnp.nan)
    out = pallas_paged_attention(q, k_pool, v_pool, 1, table, q_pos, 0.4, 8, kv_heads_per_step=kv_heads_per_step,
                                 interpret=interpret)
    for b in range(3):
        n = int(q_pos[b, -1]) + 1
        want = numpy_attention(np.asarray(q[b], np.float64), unpaged(k_pool, 1, table[b], n),
                               unpaged(v_pool, 1, table[b], n), np.asarray(q_pos[b]), 0.4)
        np.testing.assert_allclose(np.asarray(out[b]), want, atol=1e-5, rtol=1e-5)


def test_pallas_lowers_for_tpu():
    """The compiled (not interpreted) kernel lowers to a Mosaic TPU custom call, exported from CPU: block
    shapes, scalar prefetch and the kernel body pass Pallas's TPU lowering (Mosaic's own compile runs on a
    TPU only). One kv head per step is refused there: a block's second-minor dim must be whole or a
    multiple of 8."""
    b, t, w, page, kv, h, d = 2, 4, 8, 16, 2, 8, 128
    spec = jax.ShapeDtypeStruct
    args = (spec((b, t, h, d), jnp.bfloat16), spec((2, 32, page, kv, d), jnp.bfloat16),
            spec((2, 32, page, kv, d), jnp.bfloat16), spec((), jnp.int32), spec((b, w), jnp.int32),
            spec((b, t), jnp.int32))

    def compiled(*a, kv_heads_per_step=None):
        return pallas_paged_attention(*a, 0.1, 32, kv_heads_per_step=kv_heads_per_step, interpret=False)

    exported = jax.export.export(jax.jit(compiled), platforms=("tpu",))(*args)
    assert "tpu_custom_call" in exported.mlir_module()
    with pytest.raises(ValueError, match="kv_heads_per_step=1 must be num kv heads 2 or a multiple of 8"):
        jax.export.export(jax.jit(partial(compiled, kv_heads_per_step=1)), platforms=("tpu",))(*args)
