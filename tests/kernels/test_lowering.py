"""Each kernel family lowered for TPU and CUDA from this CPU host (`jax.export`: trace + lower, no compile).

The platform is explicit (`tx.kernels.platform`), so a program built for "tpu" carries the compiled Pallas
TPU kernels (a Mosaic `tpu_custom_call`, whose block shapes pass Mosaic's lowering rules here) and one built
for "cuda" carries none of them ("auto" picks cuDNN, ragged_dot; paged attention stays in XLA). No lowered
program calls back into Python. cuDNN itself cannot be traced without a GPU ("cuDNN is not detected"): that
"auto" picks it on cuda is checked with a stand-in; its lowering is the device suite's.
On an 8-device TPU mesh a bare Mosaic call does not lower (GSPMD cannot partition it); the layers call the
attention kernels per device (tx/models/layers/attention.py, a shard_map), and so they lower.
The whole training/sampling programs are lowered in tests/backends/test_lowering.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.lowering import MOSAIC, assert_no_host_callbacks, custom_calls, lower, mosaic_kernels
from tx.kernels import attention as attn
from tx.kernels.gmm import gmm, resolve_impl
from tx.kernels.paged_attention import PagedKV, paged_attention
from tx.kernels.platform import normalise, platform_of
from tx.models.config import ModelConfig
from tx.models.layers.attention import KV_AXES, POOL_AXES, Q_AXES, local_paged_attention, local_with_local_grads
from tx.models.layers.moe import SparseMoE
from tx.models.logical import LogicalSharding
from tx.models.sharding import make_mesh

f32, i32 = jnp.float32, jnp.int32
SPLASH_FWD_BWD = {"splash_mqa_fwd_segmented_residuals", "splash_mqa_dq_segmented_no_residuals",
                  "splash_mqa_dkv_segmented_no_residuals"}


def _qkv(dtype=f32, b=2, t=40, h=4, kv=2, d=16):
    spec = jax.ShapeDtypeStruct
    return spec((b, t, h, d), dtype), spec((b, t, kv, d), dtype), spec((b, t, kv, d), dtype), spec((b, t), i32)


def _attention_fwd_bwd(impl: str, platform: str):
    def loss(q, k, v, seg):
        return jnp.sum(attn.self_attention(q, k, v, seg, 0.25, impl, platform).astype(f32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def test_platform_names():
    assert [normalise(p) for p in ("cpu", "GPU", "cuda", "tpu")] == ["cpu", "cuda", "cuda", "tpu"]
    with pytest.raises(ValueError, match="platform='tpuv5'"):
        normalise("tpuv5")
    assert platform_of() == platform_of(jax.devices()) == platform_of(make_mesh(2, 2, 2, jax.devices())) == "cpu"


def test_auto_picks_by_the_platform_passed_in():
    picks = {p: (attn.resolve_attention_impl("auto", p), resolve_impl("auto", p))
             for p in ("cpu", "gpu", "cuda", "tpu")}
    assert picks == {"cpu": ("blockwise", "blocked"), "gpu": ("cudnn", "ragged_dot"), "cuda": ("cudnn", "ragged_dot"),
                     "tpu": ("splash", "megablox")}


@pytest.mark.parametrize("platform,impl", [("tpu", "auto"), ("tpu", "blockwise"), ("tpu", "reference"),
                                           ("cuda", "auto"), ("cuda", "blockwise"), ("cuda", "reference")])
def test_self_attention_lowers(platform, impl):
    """Forward and backward (float32: "auto" on cuda is cuDNN's dispatch, which runs blockwise for float32)."""
    module = lower(_attention_fwd_bwd(impl, platform), platform, *_qkv())
    if platform == "tpu" and impl == "auto":
        assert set(mosaic_kernels(module)) == SPLASH_FWD_BWD
    else:
        assert MOSAIC not in custom_calls(module)
    assert_no_host_callbacks(module)


def test_cuda_auto_picks_cudnn(monkeypatch):
    """bf16 attention built for cuda goes to cuDNN (a stand-in here: tracing cuDNN needs a GPU); built for cpu
    or tpu it never does."""
    calls = []

    def cudnn_stand_in(q, k, v, lengths_b, scale):
        calls.append(q.dtype)
        return q

    monkeypatch.setattr(attn, "_cudnn_attention", cudnn_stand_in)
    for platform in ("cuda", "gpu", "cpu", "tpu"):
        jax.eval_shape(_attention_fwd_bwd("auto", platform), *_qkv(jnp.bfloat16))
    assert calls == [jnp.bfloat16, jnp.bfloat16]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_gmm_auto_lowers(platform):
    """LoRA-shaped grouped matmuls (rank 2 out, then in), forward and backward: megablox on tpu (whose VJP
    transposes the weight, so its tiles must fit both orientations), ragged_dot on cuda."""
    spec = jax.ShapeDtypeStruct
    x, a, b, sizes = spec((40, 64), f32), spec((4, 64, 2), f32), spec((4, 2, 48), f32), spec((4,), i32)

    def loss(x, a, b, s):
        h = gmm(x, a, s, impl="auto", platform=platform)
        return jnp.sum(gmm(h, b, s, impl="auto", platform=platform) ** 2)

    module = lower(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platform, x, a, b, sizes)
    calls = custom_calls(module)
    assert calls[MOSAIC] == (6 if platform == "tpu" else 0)  # per gmm: forward, dx (gmm), dw (tgmm)
    assert_no_host_callbacks(module)


@pytest.fixture(scope="module")
def moe_config(tiny_dirs) -> ModelConfig:
    return ModelConfig.from_dir(tiny_dirs["moe"])


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_moe_layer_lowers(platform, moe_config):
    """The MoE block built for `platform` (its "auto" kernel is chosen at construction), with LoRA rows of two
    adapters (its backward is lowered in the training programs, tests/backends/test_lowering.py)."""
    layer = SparseMoE(moe_config, num_adapters=2, rank=2, stack=(), dtype=f32, rngs=nnx.Rngs(0), platform=platform)
    graphdef, state = nnx.split(layer)
    assert layer.platform == platform

    def forward(state, x_btd, adapter_b):
        return nnx.merge(graphdef, state)(x_btd, adapter_b)

    x = jax.ShapeDtypeStruct((2, 24, moe_config.hidden_size), f32)
    module = lower(jax.jit(forward), platform, state, x, jax.ShapeDtypeStruct((2,), i32))
    if platform == "tpu":
        # gate/up/down x (base, LoRA A, LoRA B): 9 megablox calls, lowered once per distinct shape (gate and up
        # share their functions)
        assert custom_calls(module)[MOSAIC] == 6
    else:
        assert MOSAIC not in custom_calls(module)
    assert_no_host_callbacks(module)


@pytest.mark.parametrize("platform,impl", [("tpu", "pallas"), ("tpu", "blocked"), ("cuda", "blocked"),
                                           ("cuda", "pallas")])
def test_paged_attention_lowers(platform, impl):
    """Decode (t = 1) over the page pools: the ragged paged attention kernel compiled on tpu; on cuda the
    Pallas TPU kernel runs interpreted (no Mosaic call), the XLA "blocked" kernel is the choice there."""
    spec = jax.ShapeDtypeStruct
    args = (spec((4, 1, 8, 128), jnp.bfloat16), spec((2, 16, 16, 2, 128), jnp.bfloat16),
            spec((2, 16, 16, 2, 128), jnp.bfloat16), spec((), i32), spec((4, 4), i32), spec((4, 1), i32))
    fn = jax.jit(lambda *a: paged_attention(*a, 0.1, impl, 32, platform))
    module = lower(fn, platform, *args)
    want = ["ragged_paged_attention"] if (platform, impl) == ("tpu", "pallas") else []
    assert mosaic_kernels(module) == want
    assert_no_host_callbacks(module)


def _sharded(mesh, spec, shape, dtype=f32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


SHARDED_MESHES = [(2, 2, 2), (8, 1, 1), (1, 1, 8)]


def _heads(mesh, h: int = 8, kv: int = 8) -> LogicalSharding:
    return LogicalSharding(mesh, heads=(h, kv))


@pytest.mark.parametrize("shape", SHARDED_MESHES, ids=lambda m: "x".join(map(str, m)))
def test_splash_lowers_per_device_on_a_sharded_mesh(shape):
    """The layer's self-attention call (`local_with_local_grads`: a shard_map over rows and heads, and its
    backward per device) lowers the splash kernels, forward and backward, on an 8-device TPU mesh; GSPMD
    alone cannot partition a Mosaic call (`test_bare_mosaic_kernel_is_refused_on_a_sharded_mesh`)."""
    mesh = make_mesh(*shape, jax.devices())
    shard = _heads(mesh)
    q, k, v, seg = _qkv(b=8, h=8, kv=8)
    names = (Q_AXES, KV_AXES, KV_AXES, ("batch", "length"))
    args = [_sharded(mesh, shard.spec(n, a.shape), a.shape, a.dtype) for n, a in zip(names, (q, k, v, seg))]
    kernel = functools.partial(attn.self_attention, scale=0.25, impl="splash", platform="tpu")
    run = local_with_local_grads(shard, kernel, names, Q_AXES, [a.shape for a in args], q.shape)

    def loss(q, k, v, s):
        return jnp.sum(run(q, k, v, s) ** 2)

    module = lower(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), "tpu", *args)
    assert set(mosaic_kernels(module)) == SPLASH_FWD_BWD
    assert_no_host_callbacks(module)


@pytest.mark.parametrize("shape", SHARDED_MESHES, ids=lambda m: "x".join(map(str, m)))
def test_paged_pallas_lowers_per_device_on_a_sharded_mesh(shape):
    """The layer's paged read (`local_paged_attention`: rows over fsdp, heads over tp, the pools whole over
    fsdp and split over tp like the kv heads) lowers the ragged paged attention kernel on an 8-device TPU
    mesh."""
    mesh = make_mesh(*shape, jax.devices())
    shard, bf16 = _heads(mesh), jnp.bfloat16
    pool = (2, 16, 16, 8, 128)
    q = _sharded(mesh, shard.spec(Q_AXES, (8, 1, 8, 128)), (8, 1, 8, 128), bf16)
    pools = [_sharded(mesh, shard.spec(POOL_AXES, pool), pool, bf16) for _ in range(2)]
    table, pos = _sharded(mesh, P("fsdp"), (8, 4), i32), _sharded(mesh, P("fsdp"), (8, 1), i32)

    def read(q, k_pool, v_pool, table, pos):
        cache = PagedKV(k_pool, v_pool, jnp.int32(1), table, pos, pos >= 0, "pallas", 32, "tpu")
        return local_paged_attention(shard, cache, q, 0.1)

    module = lower(jax.jit(read), "tpu", q, *pools, table, pos)
    assert mosaic_kernels(module) == ["ragged_paged_attention"]
    assert_no_host_callbacks(module)


@pytest.mark.parametrize("kernel", ["splash", "megablox", "paged"])
def test_bare_mosaic_kernel_is_refused_on_a_sharded_mesh(kernel):
    """Why the layers wrap every Pallas TPU kernel in a shard_map: a bare one in a program partitioned over
    several devices does not lower. (MoE's experts run per device in tx/models/layers/moe.py.)"""
    mesh = make_mesh(2, 2, 2, jax.devices())
    rows = P("fsdp")
    if kernel == "splash":
        args = [_sharded(mesh, rows, s.shape, s.dtype) for s in _qkv(b=4)]
        fn = jax.jit(lambda q, k, v, s: attn.self_attention(q, k, v, s, 0.25, "splash", "tpu"))
    elif kernel == "megablox":
        args = [_sharded(mesh, rows, (64, 64)), _sharded(mesh, P("ep"), (4, 64, 64)), _sharded(mesh, P(), (4,), i32)]
        fn = jax.jit(lambda x, w, s: gmm(x, w, s, impl="megablox", platform="tpu"))
    else:
        bf16 = jnp.bfloat16
        args = [_sharded(mesh, rows, (4, 1, 8, 128), bf16), _sharded(mesh, P(), (2, 16, 16, 2, 128), bf16),
                _sharded(mesh, P(), (2, 16, 16, 2, 128), bf16), _sharded(mesh, P(), (), i32),
                _sharded(mesh, rows, (4, 4), i32), _sharded(mesh, rows, (4, 1), i32)]
        fn = jax.jit(lambda *a: paged_attention(*a, 0.1, "pallas", 32, "tpu"))
    with pytest.raises(NotImplementedError, match="Mosaic kernels cannot be automatically partitioned"):
        lower(fn, "tpu", *args)


def test_lowered_callbacks_are_found():
    """The callback check sees what `jax.pure_callback` lowers to (so its silence on the programs means
    something; `jax.export` itself refuses such a program for another platform than the host's)."""
    def with_callback(x):
        return jax.pure_callback(lambda a: np.asarray(a) + 1, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    module = jax.jit(with_callback).lower(jax.ShapeDtypeStruct((3,), f32)).as_text()
    with pytest.raises(AssertionError, match="host callbacks in a compiled program"):
        assert_no_host_callbacks(module)
