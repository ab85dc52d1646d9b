"""Base-model log-probs equal transformers' PyTorch Qwen3 / Qwen3-MoE (float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from tests.helpers import hf_logprobs, random_batch
from tests.models.jit_logprobs import logprobs
from tx.models.config import LoraSlots
from tx.models.loading import load_model

TOL = 1e-4  # max abs difference of per-token log-probs, float32


def test_padded_batch_matches_transformers(tiny_dir):
    model = load_model(tiny_dir, LoraSlots(max_lora_adapters=2, max_lora_rank=4))
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    lengths = [13, 7, 2]
    ids, mask, targets = random_batch(0, lengths, model.config.vocab_size)
    got = np.asarray(logprobs(model, ids, mask, jnp.zeros(3, jnp.int32), targets))
    want = hf_logprobs(hf, ids, mask, targets)
    valid = mask.astype(bool)
    assert np.abs(got - want)[valid].max() <= TOL
    # every padded row equals that sequence run alone, unpadded
    for row, n in enumerate(lengths):
        alone = logprobs(model, ids[row : row + 1, :n], mask[row : row + 1, :n], jnp.zeros(1, jnp.int32), targets[row : row + 1, :n])
        np.testing.assert_allclose(got[row, :n], np.asarray(alone)[0], atol=1e-5)


def test_chunking_and_checkpointing_do_not_change_results(tiny_dirs):
    ids, mask, targets = random_batch(1, [11, 9], 512)
    adapters = jnp.zeros(2, jnp.int32)
    plain = load_model(tiny_dirs["moe_no_norm_mixed"], LoraSlots(max_lora_adapters=2, max_lora_rank=4))
    remat = load_model(
        tiny_dirs["moe_no_norm_mixed"], LoraSlots(max_lora_adapters=2, max_lora_rank=4), remat_policy="layer"
    )
    ref = np.asarray(logprobs(plain, ids, mask, adapters, targets, chunk_size=10_000))
    for chunk in (1, 6, 16):
        np.testing.assert_allclose(np.asarray(logprobs(plain, ids, mask, adapters, targets, chunk_size=chunk)), ref, atol=1e-6)
    np.testing.assert_allclose(np.asarray(logprobs(remat, ids, mask, adapters, targets)), ref, atol=1e-6)


def test_mixed_layers_are_stacked_in_runs(tiny_dirs):
    model = load_model(tiny_dirs["moe_no_norm_mixed"])
    # decoder_sparse_step=2 makes layers 1, 3 sparse; mlp_only_layers=[3] makes layer 3 dense again
    assert [(s.moe, s.layer_ids) for s in model.stacks] == [(False, (0,)), (True, (1,)), (False, (2, 3))]


def test_every_remat_policy_gives_the_same_gradients(tiny_dirs):
    """Gradient checkpointing only changes what is recomputed: gradients w.r.t. every weight match "none" (no layer
    recomputed; test_lora_gradients_match_peft checks it against PyTorch)."""
    ids, mask, targets = random_batch(2, [11, 9], 512)
    adapters = jnp.zeros(2, jnp.int32)

    def grads(policy):
        model = load_model(tiny_dirs["moe_no_norm_mixed"], LoraSlots(max_lora_adapters=2, max_lora_rank=4),
                           remat_policy=policy)

        @nnx.jit
        def go(model):
            def loss(model):
                hidden = model(ids, mask, adapters)
                return -jnp.sum(model.target_logprobs(hidden, targets, adapters, chunk_size=8) * mask)

            return nnx.grad(loss)(model)

        return jax.tree.leaves(go(model))

    want = grads("none")
    for policy in ("layer", "dots_saveable"):  # dots_with_no_batch_dims_saveable: a variant of the second
        for got, ref in zip(grads(policy), want, strict=True):
            ref = np.asarray(ref)  # recomputation may reorder float sums: 1e-4 of each weight's largest gradient
            np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max() + 1e-9)
