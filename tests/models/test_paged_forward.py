"""The model's paged path (the sampling engine's): a prompt prefilled chunk by chunk into KV pages, then
decoded token by token, gives the logits of the plain forward over the whole sequence (itself checked
against transformers in test_qwen3_parity.py), for dense and MoE models with mixed LoRA adapters and the
blocked and Pallas (interpret mode on CPU) attention kernels; the decode program updates the donated pools
in place."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tx.models import decoder
from tx.models.adapters import init_adapter
from tx.models.config import LoraSlots
from tx.models.layers.lora import LoraA, LoraB
from tx.models.loading import load_model
from tx.models.sharding import make_mesh

SLOTS = LoraSlots(max_lora_adapters=3, max_lora_rank=4)
PAGE, PAGES, CHUNK = 4, 40, 8


def model_with_adapters(model_dir):
    model = load_model(model_dir, SLOTS)
    init_adapter(model, 1, rank=4, alpha=8, seed=0)
    init_adapter(model, 2, rank=2, alpha=4, seed=1)
    lora = nnx.state(model, (LoraA, LoraB))
    leaves, treedef = jax.tree.flatten(lora)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    nnx.update(model, jax.tree.unflatten(treedef, [0.2 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]))
    return model


def empty_pools(model, pages=PAGES):
    cfg = model.config
    shape = lambda n: (n, pages, PAGE, cfg.num_key_value_heads, cfg.head_dim)  # noqa: E731
    return [(jnp.zeros(shape(len(s.layer_ids)), jnp.float32), jnp.zeros(shape(len(s.layer_ids)), jnp.float32))
            for s in model.stacks]


def paged_runner(model, impl, kv_block):
    graphdef, state = nnx.split(model)

    @partial(jax.jit, donate_argnums=(5,))
    def run(state, ids, pos, valid, adapters, pools, table):
        m = nnx.merge(graphdef, state)
        h, pools = m.paged_forward(ids, pos, valid, adapters, pools, table, impl, kv_block)
        return m.logits(h, adapters), pools

    return lambda *args: run(state, *args)


@pytest.mark.parametrize("name,impl,kv_block", [("dense", "blocked", 8), ("moe", "blocked", 4), ("dense", "pallas", 8)])
def test_chunked_prefill_then_decode_equals_forward(tiny_dirs, name, impl, kv_block):
    model = model_with_adapters(tiny_dirs[name])
    rng = np.random.default_rng(0)
    lengths, adapters = [13, 5, 20], np.array([1, 0, 2], np.int32)
    seqs = [rng.integers(0, model.config.vocab_size, n) for n in lengths]
    t = max(lengths)
    ids = np.zeros((3, t), np.int32)
    mask = np.zeros((3, t), np.int32)
    for b, s in enumerate(seqs):
        ids[b, : len(s)], mask[b, : len(s)] = s, 1
    want = np.asarray(model.logits(model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(adapters)),
                                   jnp.asarray(adapters)))

    run = paged_runner(model, impl, kv_block)
    pools = empty_pools(model)
    width = -(-t // PAGE)
    table = np.zeros((3, width), np.int32)
    free = list(rng.permutation(np.arange(1, PAGES)))
    for b, n in enumerate(lengths):
        table[b, : -(-n // PAGE)] = [free.pop() for _ in range(-(-n // PAGE))]
    got = np.zeros_like(want)
    prefill = [n - 1 for n in lengths]  # every token but the last, CHUNK positions per call
    for start in range(0, max(prefill), CHUNK):
        pos = start + np.arange(CHUNK)[None, :].repeat(3, 0)
        valid = pos < np.asarray(prefill)[:, None]
        chunk_ids = np.where(valid, np.take_along_axis(np.pad(ids, ((0, 0), (0, CHUNK))), pos, 1), 0)
        logits, pools = run(jnp.asarray(chunk_ids), jnp.asarray(np.where(valid, pos, 0)), jnp.asarray(valid),
                            jnp.asarray(adapters), pools, jnp.asarray(table))
        for b in range(3):
            for j in np.flatnonzero(valid[b]):
                got[b, pos[b, j]] = logits[b, j]
    last = np.asarray(lengths)[:, None] - 1  # one decode step per row: its own last token
    logits, pools = run(jnp.asarray(np.take_along_axis(ids, last, 1)), jnp.asarray(last),
                        jnp.ones((3, 1), bool), jnp.asarray(adapters), pools, jnp.asarray(table))
    for b, n in enumerate(lengths):
        got[b, n - 1] = logits[b, 0]
        np.testing.assert_allclose(got[b, :n], want[b, :n], atol=1e-4, rtol=1e-4, err_msg=f"row {b}")  # f32 summation order
    assert np.count_nonzero(np.asarray(pools[0][0])[:, 0]) > 0  # padding went to the trash page only


@pytest.mark.parametrize("name", ["dense", "moe", "moe_no_norm_mixed"])
def test_a_prefill_keeps_each_rows_last_token_hidden_state(tiny_dirs, name):
    """`paged_forward(..., last_at_r=...)` (a prefill call keeping its prompts' last tokens, scanned layers; two
    layer stacks in "moe_no_norm_mixed"): the hidden state `[b, 1, d]` of token `last_at_r[i]` of each row, whose
    logits are the plain forward's at that token, and the pools the call without it writes, but the trash page."""
    model = model_with_adapters(tiny_dirs[name])
    rng = np.random.default_rng(1)
    lengths, adapters = np.array([7, 3, 8, 1]), jnp.asarray(np.array([1, 0, 2, 1], np.int32))
    ids = rng.integers(0, model.config.vocab_size, (4, CHUNK)).astype(np.int32)
    valid = np.arange(CHUNK)[None, :] < lengths[:, None]
    ids = np.where(valid, ids, 0)
    want = np.asarray(model.logits(model(jnp.asarray(ids), jnp.asarray(valid.astype(np.int32)), adapters), adapters))
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, pools, last_r):
        m = nnx.merge(graphdef, state)
        pos = jnp.asarray(np.where(valid, np.arange(CHUNK)[None, :], 0))
        table = jnp.asarray(1 + np.arange(4 * CHUNK // PAGE, dtype=np.int32).reshape(4, CHUNK // PAGE))
        h, pools = m.paged_forward(jnp.asarray(ids), pos, jnp.asarray(valid), adapters, pools, table, "blocked", 8,
                                   last_at_r=last_r)
        return m.logits(h, adapters), pools

    last_r = jnp.asarray(lengths - 1, dtype=jnp.int32)
    logits, pools = run(state, empty_pools(model), last_r)
    assert logits.shape == (4, 1, model.config.vocab_size)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b, 0], want[b, n - 1], atol=1e-4, rtol=1e-4, err_msg=f"row {b}")

    def whole(state, pools):
        m = nnx.merge(graphdef, state)
        pos = jnp.asarray(np.where(valid, np.arange(CHUNK)[None, :], 0))
        table = jnp.asarray(1 + np.arange(4 * CHUNK // PAGE, dtype=np.int32).reshape(4, CHUNK // PAGE))
        return m.paged_forward(jnp.asarray(ids), pos, jnp.asarray(valid), adapters, pools, table, "blocked", 8)[1]

    for got, plain in zip(jax.tree.leaves(pools), jax.tree.leaves(jax.jit(whole)(state, empty_pools(model)))):
        np.testing.assert_array_equal(np.asarray(got)[:, 1:], np.asarray(plain)[:, 1:])


def test_decode_updates_the_pools_in_place(tiny_dirs):
    """The decode program's XLA temporaries are a small fraction of the pools, which are aliased (donated):
    no per-layer or per-step copy of the cache."""
    model = model_with_adapters(tiny_dirs["dense"])
    graphdef, state = nnx.split(model)
    pools = empty_pools(model, pages=8192)  # pools much larger than the activations

    def run(state, ids, pos, valid, adapters, pools, table):
        m = nnx.merge(graphdef, state)
        return m.paged_forward(ids, pos, valid, adapters, pools, table, "blocked", 16)

    args = (jnp.zeros((4, 1), jnp.int32), jnp.full((4, 1), 37), jnp.ones((4, 1), bool), jnp.zeros(4, jnp.int32), pools,
            jnp.ones((4, 16), jnp.int32))
    mem = jax.jit(run, donate_argnums=(5,)).lower(state, *args).compile().memory_analysis()
    pool_bytes = sum(x.nbytes for x in jax.tree.leaves(pools))
    assert mem.alias_size_in_bytes >= pool_bytes
    assert mem.temp_size_in_bytes < 0.1 * pool_bytes, (mem.temp_size_in_bytes, pool_bytes)


def _prefill_args(model, b=4, t=16):
    rng = np.random.default_rng(3)
    ids = rng.integers(0, model.config.vocab_size, (b, t)).astype(np.int32)
    adapters = np.array([1, 0, 2, 1], np.int32)[:b]
    table = 1 + np.arange(b * t // PAGE, dtype=np.int32).reshape(b, t // PAGE)
    return (jnp.asarray(ids), jnp.asarray(np.tile(np.arange(t), (b, 1))), jnp.ones((b, t), bool),
            jnp.asarray(adapters)), jnp.asarray(table)


def _loops(model, args, table) -> int:
    """The while loops of the paged program (traced anew: under the constants set now)."""
    graphdef, state = nnx.split(model)

    def hidden(state, *args):
        return nnx.merge(graphdef, state).paged_forward(*args, "blocked", 8)[0]

    return jax.jit(hidden).lower(state, *args, empty_pools(model), table).as_text().count("stablehlo.while")


def test_prefill_mlp_in_row_groups(tiny_dirs, monkeypatch):
    """A paged call over more tokens than `PAGED_MLP_TOKENS` allows runs its MLP over groups of rows in turn (a
    loop in the program): its logits are the plain forward's, and its logits and pools the bits of the call run at
    once."""
    model = model_with_adapters(tiny_dirs["dense"])
    args, table = _prefill_args(model)
    ids, _, _, adapters = args
    want = np.asarray(model.logits(model(ids, jnp.ones(ids.shape, jnp.int32), adapters), adapters))
    out, loops = {}, {}
    for most in (4, None):  # 4 tokens: 4 groups of one row (16 tokens each: the smallest group is a row)
        monkeypatch.setattr(decoder, "PAGED_MLP_TOKENS", {"cpu": most})
        loops[most] = _loops(model, args, table)
        logits, pools = paged_runner(model, "blocked", 8)(*args, empty_pools(model), table)
        out[most] = np.asarray(logits), [np.asarray(p) for p in jax.tree.leaves(pools)]
        np.testing.assert_allclose(out[most][0], want, atol=1e-4, rtol=1e-4)
    assert loops[4] > loops[None], loops  # the groups' loop
    np.testing.assert_array_equal(out[4][0], out[None][0])
    for grouped, whole in zip(out[4][1], out[None][1]):
        np.testing.assert_array_equal(grouped, whole)


def test_prefill_mlp_at_once_over_several_devices(tiny_dirs, monkeypatch):
    """Rows sharded over a mesh: the MLP runs at once (the groups were measured on one device only)."""
    single = model_with_adapters(tiny_dirs["dense"])
    args, table = _prefill_args(single)
    monkeypatch.setattr(decoder, "PAGED_MLP_TOKENS", {"cpu": None})
    at_once = _loops(single, args, table)
    monkeypatch.setattr(decoder, "PAGED_MLP_TOKENS", {"cpu": 4})
    assert _loops(single, args, table) > at_once
    sharded = load_model(tiny_dirs["dense"], SLOTS, make_mesh(2, 1, 1, jax.devices()[:2]))
    assert _loops(sharded, args, table) == at_once
