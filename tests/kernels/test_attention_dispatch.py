"""The attention_impl dispatch: names, platform defaults, and the model's training and plain forward paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tx.kernels.attention import (
    SELF_ATTENTION_IMPLS,
    reference_self_attention,
    resolve_attention_impl,
    segment_ids_for_attention,
    self_attention,
)
from tx.models.config import LoraSlots
from tx.models.loading import load_model


def test_auto_picks_by_platform_and_unknown_names_fail():
    assert resolve_attention_impl("auto", "tpu") == "splash"
    assert resolve_attention_impl("auto", "gpu") == "cudnn"
    assert resolve_attention_impl("auto", "cpu") == "blockwise"
    assert set(SELF_ATTENTION_IMPLS) == {"reference", "blockwise", "cudnn", "splash"}
    with pytest.raises(ValueError, match="attention_impl='flash2'"):
        resolve_attention_impl("flash2")


def test_segment_ids_mark_padding():
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]])
    seg = segment_ids_for_attention(mask, jnp.array([[0, 1, 1, 0], [0, 0, 0, 0]]))
    np.testing.assert_array_equal(seg, [[0, 1, 1, -1], [0, 0, 0, 0]])
    np.testing.assert_array_equal(segment_ids_for_attention(mask), [[0, 0, 0, -1], [0, 0, 0, 0]])


def test_cudnn_off_gpu_falls_back_to_blockwise_exactly():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 9, n, 8)), jnp.float32) for n in (4, 2, 2))
    seg = jnp.array([[0] * 5 + [1] * 4, [0] * 7 + [-1] * 2], jnp.int32)
    want = reference_self_attention(q, k, v, seg, 0.3)
    for impl in ("cudnn", "auto", "blockwise"):
        np.testing.assert_allclose(self_attention(q, k, v, seg, 0.3, impl), want, atol=1e-5, err_msg=impl)


def test_model_rejects_unknown_attention_impl(tiny_dirs):
    with pytest.raises(ValueError, match="attention_impl='dense'"):
        load_model(tiny_dirs["dense"], attention_impl="dense")


def test_model_blockwise_equals_reference_with_packing_and_padding(tiny_dirs):
    """Training forward (packed segments + padding) and the plain forward of padded rows (prompt scoring's):
    log-probs, LoRA gradients and hidden states agree."""
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(3, 500, (2, 13)), jnp.int32)
    mask = jnp.asarray([[1] * 13, [1] * 10 + [0] * 3], jnp.int32)
    segments = jnp.asarray([[0] * 6 + [1] * 7, [0] * 13], jnp.int32)
    targets = jnp.roll(ids, -1, axis=1)
    adapters = jnp.array([0, 1], jnp.int32)

    def run(impl):
        model = load_model(tiny_dirs["dense"], LoraSlots(max_lora_adapters=2, max_lora_rank=4), attention_impl=impl)
        lora = nnx.All(nnx.Param, nnx.PathContains("lora_b"))

        @nnx.jit
        def go(model):
            def loss(model):
                hidden = model(ids, mask, adapters, segment_ids_bt=segments)
                lp = model.target_logprobs(hidden, targets, adapters)
                return -jnp.sum(lp * mask), lp

            (_, lp), grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, lora), has_aux=True)(model)
            hidden = model(ids, mask, adapters)  # no segment ids: one sequence per row, right-padded
            return lp, jax.tree.leaves(grads), hidden

        return go(model)

    want, got = run("reference"), run("blockwise")
    valid = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(got[0])[valid], np.asarray(want[0])[valid], atol=1e-5)
    for g, r in zip(got[1], want[1], strict=True):
        r = np.asarray(r)
        np.testing.assert_allclose(np.asarray(g), r, atol=1e-5 * max(1.0, np.abs(r).max()))
    np.testing.assert_allclose(np.asarray(got[2])[valid], np.asarray(want[2])[valid], atol=1e-5)
