"""No silent kernel fallbacks: an explicitly named kernel that cannot run is refused or logged once, naming
what runs instead; "auto" stays quiet. GPU-only branches run here with the platform check patched and
cuDNN replaced by a dense stand-in (the real cuDNN path needs a GPU)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx.kernels import attention as attn
from tx.kernels.attention import reference_self_attention, self_attention, self_attention_mask
from tx.kernels.gmm import gmm
from tx.kernels.paged_attention import paged_attention
from tx.log import forget_warnings, warn_once


@pytest.fixture(autouse=True)
def fresh_warnings():
    forget_warnings()
    yield
    forget_warnings()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _qkv(dtype=jnp.float32, t=9, d=8, h=4, kv=2):
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal((2, t, n, d)), dtype) for n in (h, kv, kv))


PACKED = jnp.array([[0] * 5 + [1] * 4, [0] * 7 + [-1] * 2], jnp.int32)
RIGHT_PADDED = jnp.array([[0] * 9, [0] * 7 + [-1] * 2], jnp.int32)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Take the GPU branches on CPU: cuDNN becomes dense attention under its causal + lengths mask."""

    def dense_cudnn(q, k, v, lengths_b, scale):
        t = q.shape[1]
        real_bs = jnp.arange(t)[None, :] < lengths_b[:, None]
        mask_bts = jnp.tril(jnp.ones((t, t), bool))[None] & real_bs[:, None, :]
        return attn.attention(q, k, v, mask_bts, scale)

    monkeypatch.setattr(attn, "_on_gpu", lambda platform: True)
    monkeypatch.setattr(attn, "_cudnn_attention", dense_cudnn)


def test_warn_once_logs_each_key_once(caplog):
    with caplog.at_level(logging.WARNING):
        assert warn_once(("f", "x", "r"), "first")
        assert not warn_once(("f", "x", "r"), "again")
        assert warn_once(("f", "x", "other"), "second")
    assert _warnings(caplog) == ["first", "second"]


def test_cudnn_off_gpu_warns_once_and_auto_is_quiet(caplog):
    q, k, v = _qkv()
    with caplog.at_level(logging.WARNING):
        self_attention(q, k, v, PACKED, 0.3, "auto")
        assert _warnings(caplog) == []
        self_attention(q, k, v, PACKED, 0.3, "cudnn")
        jax.jit(lambda *a: self_attention(*a, 0.3, "cudnn"))(q[:, :5], k[:, :5], v[:, :5], PACKED[:, :5])
    platform = jax.default_backend()
    assert _warnings(caplog) == [
        f"attention_impl='cudnn' cannot run on {platform} (cuDNN needs a GPU); running 'blockwise' instead"]


def test_cudnn_float32_warns_once_and_auto_is_quiet(caplog, fake_gpu):
    q, k, v = _qkv(jnp.float32)
    want = reference_self_attention(q, k, v, RIGHT_PADDED, 0.3)
    with caplog.at_level(logging.WARNING):
        np.testing.assert_allclose(self_attention(q, k, v, RIGHT_PADDED, 0.3, "auto"), want, atol=1e-5)
        assert _warnings(caplog) == []
        for _ in range(2):
            np.testing.assert_allclose(self_attention(q, k, v, RIGHT_PADDED, 0.3, "cudnn"), want, atol=1e-5)
    assert _warnings(caplog) == ["attention_impl='cudnn' cannot run float32 inputs (cuDNN flash attention takes "
                                 "bfloat16 or float16); running 'blockwise' instead"]


def test_cudnn_head_size_it_never_takes_is_refused(caplog, fake_gpu):
    q, k, v = _qkv(jnp.bfloat16, d=12)
    with pytest.raises(ValueError, match=r"attention_impl='cudnn' cannot run head_dim=12: cuDNN flash attention "
                                         r"takes a multiple of 8 up to 256; set attention_impl='blockwise'"):
        self_attention(q, k, v, RIGHT_PADDED, 0.3, "cudnn")
    with caplog.at_level(logging.WARNING):
        self_attention(q, k, v, RIGHT_PADDED, 0.3, "auto")  # auto: blockwise, quietly
    assert _warnings(caplog) == []


def test_cudnn_runs_blockwise_for_packed_rows_and_the_backend_says_so(caplog, fake_gpu, tiny_dirs):
    """Packed rows are decided on device (lax.cond: right-padded single segments take cuDNN, the rest blockwise,
    also under remat and grad); the backend, which holds the rows on the host, warns once when an explicit
    'cudnn' meets packed rows, so the compiled program carries no host callback."""
    import tx
    from tests.helpers import make_batch

    q, k, v = _qkv(jnp.bfloat16)
    real = np.asarray(RIGHT_PADDED >= 0)  # padding queries' outputs are garbage in every kernel
    for seg in (RIGHT_PADDED, jnp.where(real, PACKED, -1)):
        want = reference_self_attention(q, k, v, seg, 0.3)
        got = jax.jit(jax.checkpoint(lambda q, s: self_attention(q, k, v, s, 0.3, "cudnn")))(q, seg)
        np.testing.assert_allclose(np.asarray(got, np.float32)[real], np.asarray(want, np.float32)[real], atol=2e-2)
        grad = jax.grad(lambda q, s: jnp.sum(self_attention(q, k, v, s, 0.3, "cudnn").astype(jnp.float32) ** 2))
        assert np.isfinite(np.asarray(grad(q, seg), np.float32)).all()
    assert "callback" not in str(jax.make_jaxpr(lambda s: self_attention_mask(s >= 0, s, "cudnn").segment_ids_bt)(PACKED))

    backend = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(max_lora_adapters=2, max_lora_rank=1,
                                                                     max_seq_len=32, attention_impl="cudnn"))
    datum = {"input_ids": list(range(1, 9)), "targets": list(range(2, 10))}
    packed = "attention_impl='cudnn' cannot run a batch with packed rows"
    with caplog.at_level(logging.WARNING):
        backend.forward(make_batch([("r", "", [datum], "cross_entropy", None)]))
        assert not [w for w in _warnings(caplog) if w.startswith(packed)]
        for _ in range(2):
            out = backend.forward(make_batch([("r", "", [datum], "cross_entropy", None)],
                                             all_segment_ids=[[0] * 4 + [1] * 4]))
            assert out["r"].loss_fn_outputs
    assert [w for w in _warnings(caplog) if w.startswith(packed)] == [
        "attention_impl='cudnn' cannot run a batch with packed rows (several segment ids in a row, as SFT packs) "
        "(cuDNN takes one right-padded sequence per row); running 'blockwise' instead"]


# The off-TPU tests below skip on a TPU only (a hardware skip, not a missing prerequisite: CI runs them on CPU).
def test_splash_off_tpu_warns_once(caplog):
    if jax.default_backend() == "tpu":
        pytest.skip("splash is compiled on TPU")
    q, k, v = _qkv(t=16)
    seg = jnp.zeros((2, 16), jnp.int32)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            jax.eval_shape(lambda q, k, v, s: self_attention(q, k, v, s, 0.3, "splash"), q, k, v, seg)
        jax.eval_shape(lambda q, k, v, s: self_attention(q, k, v, s, 0.3, "auto"), q, k, v, seg)
    assert _warnings(caplog) == [f"attention_impl='splash' on {jax.default_backend()}: running the Pallas kernel "
                                 "in interpret mode (slow; for tests)"]


def test_megablox_off_tpu_warns_once_and_auto_is_quiet(caplog):
    if jax.default_backend() == "tpu":
        pytest.skip("megablox is compiled on TPU")
    x = jnp.ones((16, 8), jnp.float32)
    w = jnp.ones((2, 8, 8), jnp.float32)
    sizes = jnp.array([10, 6], jnp.int32)
    with caplog.at_level(logging.WARNING):
        jax.eval_shape(lambda x, w, s: gmm(x, w, s, impl="auto"), x, w, sizes)
        assert _warnings(caplog) == []
        for _ in range(2):
            jax.eval_shape(lambda x, w, s: gmm(x, w, s, impl="megablox"), x, w, sizes)
    assert _warnings(caplog) == [f"moe_impl='megablox' on {jax.default_backend()}: running the Pallas kernel in "
                                 "interpret mode (slow; for tests)"]


def test_paged_pallas_off_tpu_warns_once(caplog):
    if jax.default_backend() == "tpu":
        pytest.skip("the paged Pallas kernel is compiled on TPU")
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 1, 4, 8)), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((1, 5, 4, 2, 8)), jnp.float32)
    table = jnp.array([[1, 2], [3, 4]], jnp.int32)
    pos = jnp.array([[5], [2]], jnp.int32)
    with caplog.at_level(logging.WARNING):
        jax.eval_shape(lambda q, p: paged_attention(q, p, p, 0, table, pos, 0.3, "blocked", 4), q, pool)
        assert _warnings(caplog) == []
        for _ in range(2):
            jax.eval_shape(lambda q, p: paged_attention(q, p, p, 0, table, pos, 0.3, "pallas", 4), q, pool)
    assert _warnings(caplog) == [f"paged_attention_impl='pallas' on {jax.default_backend()}: running the Pallas "
                                 "kernel in interpret mode (slow; for tests)"]
