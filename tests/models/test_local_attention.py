"""The attention kernels run per device (tx/models/layers/attention.py): each device attends its own rows and
heads in a shard_map. On 8 CPU devices, sharded equals one device, and the per-device regions add no
collective:

- self-attention (training, prefill), forward and gradients, for the reference, blockwise and splash
  (interpreted) kernels: the compiled gradient program holds no collective at all, also on meshes whose axes
  the inputs are replicated over (ep always; fsdp when the batch does not divide it), where differentiating
  the shard_map itself would all-reduce dq, dk, dv over them;
- the paged cache's read (the sampling engine), blocked and Pallas (interpreted) kernels, over several KV
  blocks: a prefill chunk then a decode step of the whole model equal one device, with rows that do not
  divide fsdp; the decode program gathers nothing over tp (the pools are split over tp like the kv heads, and
  the "blocked" kernel's `[b, s * kv, d]` reshape of a block, which GSPMD could only do on gathered keys and
  values, is local).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.models.hlo_collectives import collectives
from tx.kernels.attention import self_attention
from tx.models.config import LoraSlots
from tx.models.layers.attention import KV_AXES, POOL_AXES, Q_AXES, local_with_local_grads
from tx.models.loading import load_model
from tx.models.logical import LogicalSharding
from tx.models.sharding import make_mesh

B, T, H, KV, D = 4, 40, 4, 2, 16


def _inputs():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, D)), jnp.float32) for n in (H, KV, KV))
    lengths = np.array([40, 31, 17, 26])
    seg = np.where(np.arange(T)[None] < lengths[:, None], 0, -1)
    seg[0, 20:] = 1  # a packed row: two segments
    return q, k, v, jnp.asarray(seg, jnp.int32)


@pytest.mark.parametrize("shape,impl", [((2, 2, 2), "splash"), ((1, 8, 1), "blockwise"), ((8, 1, 1), "reference")],
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else x)
def test_self_attention_per_device(shape, impl):
    """(8, 1, 1): 4 rows do not divide fsdp=8, so every device holds them all; (1, 8, 1): everything is
    replicated over ep."""
    q, k, v, seg = _inputs()
    shard = LogicalSharding(make_mesh(*shape), heads=(H, KV))
    names = (Q_AXES, KV_AXES, KV_AXES, ("batch", "length"))
    kernel = functools.partial(self_attention, scale=0.25, impl=impl, platform="cpu")
    run = local_with_local_grads(shard, kernel, names, Q_AXES, [x.shape for x in (q, k, v, seg)], q.shape)
    args = [jax.device_put(x, shard.sharding(n, x.shape)) for n, x in zip(names, (q, k, v, seg))]

    def loss(attend, q, k, v, seg):  # a non-linear function of the output: every cotangent differs
        return jnp.sum(jnp.sin(attend(q, k, v, seg)))

    grad_fn = jax.jit(jax.value_and_grad(functools.partial(loss, run), argnums=(0, 1, 2)))
    got_loss, got = grad_fn(*args)
    oracle = functools.partial(self_attention, scale=0.25, impl="reference", platform="cpu")
    want_loss, want = jax.value_and_grad(functools.partial(loss, oracle), argnums=(0, 1, 2))(q, k, v, seg)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, err_msg=f"d{name} on {shape}")
    np.testing.assert_allclose(np.asarray(jax.jit(run)(*args)), np.asarray(oracle(q, k, v, seg)), atol=2e-5)
    hlo = grad_fn.lower(*args).compile().as_text()
    not_the_loss = [c for c in collectives(hlo, shard.mesh) if c.operands != ("f32[]",)]  # the loss's sum
    assert not_the_loss == [], shape


SLOTS = LoraSlots(max_lora_adapters=2, max_lora_rank=2)
PAGE, PAGES, WIDTH, KV_BLOCK = 4, 24, 6, 8  # 3 KV blocks of 2 pages per row


def _paged_programs(model_dir, mesh, impl):
    """(prefill chunk, decode step) of `load_model(model_dir)` on `mesh`, each returning the logits and the
    pools, and the empty pools as the engine lays them out."""
    model = load_model(model_dir, SLOTS, mesh)
    cfg = model.config
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(5,))
    def run(state, ids, pos, valid, adapters, pools, table):
        m = nnx.merge(graphdef, state)
        h, pools = m.paged_forward(ids, pos, valid, adapters, pools, table, impl, KV_BLOCK)
        return m.logits(h, adapters), pools

    shape = lambda n: (n, PAGES, PAGE, cfg.num_key_value_heads, cfg.head_dim)  # noqa: E731
    pools = [tuple(jax.device_put(jnp.zeros(shape(len(s.layer_ids)), jnp.float32),
                                  NamedSharding(mesh, model.layout.spec(POOL_AXES, shape(len(s.layer_ids)))))
                   for _ in range(2)) for s in model.stacks]
    return functools.partial(run, state), run, state, pools


@pytest.mark.parametrize("impl", ["blocked", "pallas"])
def test_paged_attention_per_device(tiny_dirs, impl):
    """3 rows (not divisible by fsdp=2: whole on every device) of 21, 9 and 15 tokens: a prefill chunk of 20
    positions, then one decode step per row, on (2, 2, 2) equal one device; the decode program's only
    collectives over tp are the row-parallel projections' all-reduces."""
    rng = np.random.default_rng(1)
    lengths = np.array([21, 9, 15])
    ids = rng.integers(0, 512, (3, 21)).astype(np.int32)
    table = np.zeros((3, WIDTH), np.int32)
    table[:] = rng.permutation(np.arange(1, PAGES))[: 3 * WIDTH].reshape(3, WIDTH)
    adapters = np.array([1, 0, 1], np.int32)
    prefill_pos = np.broadcast_to(np.arange(20, dtype=np.int32), (3, 20))
    prefill_valid = prefill_pos < (lengths - 1)[:, None]
    last = (lengths - 1)[:, None].astype(np.int32)
    calls = [(np.where(prefill_valid, ids[:, :20], 0), np.where(prefill_valid, prefill_pos, 0), prefill_valid),
             (np.take_along_axis(ids, last, 1), last, np.ones((3, 1), bool))]

    results, mesh = {}, make_mesh(2, 2, 2)
    for where in ("one", "mesh"):
        m = make_mesh(devices=jax.devices()[:1]) if where == "one" else mesh
        run, jitted, state, pools = _paged_programs(tiny_dirs["dense"], m, impl)
        put = lambda x: jax.device_put(jnp.asarray(x), NamedSharding(m, P()))  # noqa: E731
        out = []
        for call in calls:
            args = [put(x) for x in (*call, adapters)]
            if where == "mesh" and len(out) == 1:  # the decode step's program
                hlo = jitted.lower(state, *args, pools, put(table)).compile().as_text()
            logits, pools = run(*args, pools, put(table))
            out.append(np.asarray(logits))
        results[where] = out
    for step, (got, want) in enumerate(zip(results["mesh"], results["one"])):
        valid = calls[step][2]
        np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=1e-4, err_msg=f"call {step}")

    over_tp = {c.kind for c in collectives(hlo, mesh) if "tp" in c.axes}
    assert over_tp == {"all-reduce"}, over_tp  # the row-parallel o_proj's partial sums, nothing gathered
