"""Multi-adapter LoRA equals PEFT row by row; ranks below the maximum; MoE expert LoRA; PEFT-style init."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tests.helpers import hf_logprobs, peft_weights, random_batch
from tests.models.jit_logprobs import logprobs
from tests.models.test_qwen3_parity import TOL
from tx.models.adapters import clear_adapter, get_adapter_weights, init_adapter, lora_modules, set_adapter_weights
from tx.models.config import LoraSlots
from tx.models.layers.lora import LoraA, LoraB
from tx.models.loading import load_model

SLOTS = LoraSlots(max_lora_adapters=4, max_lora_rank=8)
ATTN_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]
DENSE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def _peft(model_dir, rank, alpha, targets, seed, base=None):
    torch.manual_seed(seed)
    base = base or AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    return get_peft_model(base, cfg)


@pytest.mark.parametrize("name", ["dense", "dense_tied_mha"])
def test_mixed_batch_matches_peft(tiny_dirs, name):
    model_dir = tiny_dirs[name]
    model = load_model(model_dir, SLOTS)
    # adapter 1: full rank 8; adapter 2: rank 4 < max_lora_rank, different alpha
    refs = {0: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)}
    for slot, rank, alpha, seed in [(1, 8, 16, 1), (2, 4, 8, 2)]:
        refs[slot] = _peft(model_dir, rank, alpha, DENSE_TARGETS, seed)
        set_adapter_weights(model, slot, peft_weights(refs[slot]), alpha=alpha, rank=rank)
    adapters = np.array([1, 0, 2, 2, 1, 0])
    ids, mask, targets = random_batch(3, [12, 12, 9, 5, 3, 8], model.config.vocab_size)
    got = np.asarray(logprobs(model, ids, mask, jnp.asarray(adapters), targets))
    for row, slot in enumerate(adapters):
        want = hf_logprobs(refs[slot], ids[row : row + 1], mask[row : row + 1], targets[row : row + 1])[0]
        valid = mask[row].astype(bool)
        assert np.abs(got[row] - want)[valid].max() <= TOL, f"row {row} (adapter {slot})"
    # rows on the same adapter with a different batch composition give the same result
    alone = np.asarray(logprobs(model, ids[2:3], mask[2:3], jnp.asarray([2]), targets[2:3]))
    np.testing.assert_allclose(alone[0], got[2], atol=1e-5)


def test_rank_padding_stays_zero_and_round_trips(tiny_dirs):
    model = load_model(tiny_dirs["dense"], SLOTS)
    peft = _peft(tiny_dirs["dense"], 3, 6, DENSE_TARGETS, seed=4)
    weights = peft_weights(peft)
    set_adapter_weights(model, 2, weights, alpha=6, rank=3)
    for _, module, _ in lora_modules(model):
        a, b = np.asarray(module.lora_a.get_value()), np.asarray(module.lora_b.get_value())
        assert not np.any(a[..., 2, :, 3:]) and not np.any(b[..., 2, 3:, :])  # columns past rank
        assert not np.any(a[..., [0, 1, 3], :, :]) and not np.any(b[..., [0, 1, 3], :, :])  # other slots
        np.testing.assert_allclose(np.asarray(module.lora_scale.get_value())[..., 2], 2.0)
    back = get_adapter_weights(model, 2, rank=3)
    assert back.keys() == weights.keys()
    for k, (a, b) in weights.items():
        np.testing.assert_array_equal(back[k][0], a)
        np.testing.assert_array_equal(back[k][1], b)


def _merge_mlp_lora(hf_model, mlp_weights, scale):
    """Add scale * B @ A to transformers' MLP weights: dense [out, in] linears, or the fused expert
    tensors (gate_up [E, 2F, D], down [E, D, F])."""
    with torch.no_grad():
        for name, (a, b) in mlp_weights.items():
            mlp = hf_model.model.layers[int(name.split(".")[2])].mlp
            delta = torch.tensor(scale * np.einsum("...or,...ri->...oi", b, a))
            proj = name.rsplit(".", 1)[1]
            if ".experts." not in name:
                getattr(mlp, proj).weight += delta
            elif proj == "down_proj":
                mlp.experts.down_proj += delta
            else:
                ff = mlp.experts.down_proj.shape[-1]
                mlp.experts.gate_up_proj[:, :ff] += delta if proj == "gate_proj" else 0
                mlp.experts.gate_up_proj[:, ff:] += delta if proj == "up_proj" else 0


def _random_mlp_lora(cfg, rng, rank):
    """PEFT-layout random LoRA for every MLP module: dense layers and per-expert (leading E axis)."""
    out = {}
    for layer in range(cfg.num_hidden_layers):
        moe = cfg.is_moe_layer(layer)
        d, ff = cfg.hidden_size, cfg.moe_intermediate_size if moe else cfg.intermediate_size
        lead = (cfg.num_experts,) if moe else ()
        prefix = f"model.layers.{layer}.mlp.{'experts.' if moe else ''}"
        for proj, (i, o) in {"gate_proj": (d, ff), "up_proj": (d, ff), "down_proj": (ff, d)}.items():
            a = rng.standard_normal((*lead, rank, i)).astype(np.float32) * 0.3
            b = rng.standard_normal((*lead, o, rank)).astype(np.float32) * 0.3
            out[prefix + proj] = (a, b)
    return out


@pytest.mark.production_moe_kernel
@pytest.mark.parametrize("name", ["moe", "moe_no_norm_mixed"])
def test_moe_expert_lora_matches_merged_reference(tiny_dirs, name):
    """Per-expert (and dense-MLP) LoRA, plus attention and LM-head LoRA, equals transformers with the MLP
    deltas merged into its weights and PEFT on attention and LM head, row by row in a mixed batch.
    (PEFT itself cannot be the MLP reference here: on transformers 5 it retargets gate/up/down to the
    fused expert parameters.)"""
    model_dir = tiny_dirs[name]
    model = load_model(model_dir, SLOTS)
    cfg = model.config
    rng = np.random.default_rng(5)
    refs = {0: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)}
    for slot, rank, alpha in [(1, 8, 16), (3, 5, 10)]:
        mlp = _random_mlp_lora(cfg, rng, rank)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        _merge_mlp_lora(base, mlp, alpha / rank)
        refs[slot] = _peft(model_dir, rank, alpha, ATTN_TARGETS, seed=slot, base=base)
        set_adapter_weights(model, slot, peft_weights(refs[slot]) | mlp, alpha=alpha, rank=rank)
    adapters = np.array([3, 1, 0, 1])
    ids, mask, targets = random_batch(6, [10, 10, 6, 4], cfg.vocab_size)
    got = np.asarray(logprobs(model, ids, mask, jnp.asarray(adapters), targets))
    for row, slot in enumerate(adapters):
        want = hf_logprobs(refs[slot], ids[row : row + 1], mask[row : row + 1], targets[row : row + 1])[0]
        valid = mask[row].astype(bool)
        assert np.abs(got[row] - want)[valid].max() <= TOL, f"row {row} (adapter {slot})"


def test_init_follows_peft_and_train_flags(tiny_dirs):
    model = load_model(tiny_dirs["moe_no_norm_mixed"], SLOTS)
    init_adapter(model, 1, rank=4, alpha=8, seed=0, train_attn=False, train_mlp=True, train_unembed=True)
    for path, module, _ in lora_modules(model):
        a = np.asarray(module.lora_a.get_value())[..., 1, :, :]
        b = np.asarray(module.lora_b.get_value())[..., 1, :, :]
        scale = np.asarray(module.lora_scale.get_value())[..., 1]
        assert not np.any(b)
        if "self_attn" in path:  # not trained: exactly zero, scale 0
            assert not np.any(a) and not np.any(scale)
            continue
        fan_in = a.shape[-2]
        bound = 1 / np.sqrt(fan_in)  # one layer's (one expert's) fan-in, not layers * fan_in
        live = a[..., :4]
        assert np.abs(live).max() <= bound and np.abs(live).max() > 0.8 * bound
        assert abs(live.std() - bound / np.sqrt(3)) < 0.15 * bound / np.sqrt(3)
        assert not np.any(a[..., 4:])
        np.testing.assert_allclose(scale, 2.0)
    # B = 0: a fresh adapter computes exactly the base model; clearing restores zeros
    ids, mask, targets = random_batch(7, [9, 9], 512)
    base = np.asarray(logprobs(model, ids, mask, jnp.asarray([0, 0]), targets))
    fresh = np.asarray(logprobs(model, ids, mask, jnp.asarray([1, 0]), targets))
    np.testing.assert_array_equal(fresh[0], base[0])
    clear_adapter(model, 1)
    for _, module, _ in lora_modules(model):
        assert not np.any(np.asarray(module.lora_a.get_value()))


def test_bad_rank_and_unknown_module_raise(tiny_dirs):
    model = load_model(tiny_dirs["dense"], SLOTS)
    with pytest.raises(ValueError, match="LoRA rank 9 must be in"):
        init_adapter(model, 1, rank=9, alpha=1, seed=0)
    with pytest.raises(ValueError, match="does not have"):
        set_adapter_weights(model, 1, {"model.layers.9.self_attn.q_proj": (np.zeros((2, 64)), np.zeros((64, 2)))}, alpha=1, rank=2)
    with pytest.raises(ValueError, match="do not match rank"):
        set_adapter_weights(model, 1, {"model.layers.0.self_attn.q_proj": (np.zeros((2, 63)), np.zeros((64, 2)))}, alpha=1, rank=2)


@pytest.mark.parametrize("policy", ["none", "layer"])
@pytest.mark.parametrize("targets", [DENSE_TARGETS[:-1], DENSE_TARGETS], ids=["frozen_head", "head_lora"])
def test_lora_gradients_match_peft(tiny_dirs, policy, targets):
    """The gradients of a masked cross-entropy w.r.t. every LoRA factor equal PyTorch autograd through PEFT: with
    and without gradient checkpointing (without it dense layers still recompute what lies between their weight
    matmuls), and with the LM head frozen (its log-prob backward gathers W's target columns) or adapted."""
    model_dir = tiny_dirs["dense"]
    model = load_model(model_dir, SLOTS, remat_policy=policy)
    ref = _peft(model_dir, 8, 16, targets, seed=5)
    set_adapter_weights(model, 1, peft_weights(ref), alpha=16, rank=8)
    ids, mask, targets_bt = random_batch(4, [12, 9, 5], model.config.vocab_size)
    adapters = jnp.ones(3, jnp.int32)
    head_adapters = adapters if "lm_head" in targets else None
    graphdef, lora, rest = nnx.split(model, nnx.Any(LoraA, LoraB), ...)

    def loss(lora):
        m = nnx.merge(graphdef, lora, rest)
        hidden = m(jnp.asarray(ids), jnp.asarray(mask), adapters)
        return -jnp.sum(m.target_logprobs(hidden, jnp.asarray(targets_bt), head_adapters, chunk_size=8) * mask)

    nnx.update(model, jax.jit(jax.grad(loss))(lora))  # the model's factors now hold their gradients
    got = get_adapter_weights(model, 1, 8)  # PEFT layout: {module: (dA [r, in], dB [out, r])}
    logits = ref(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits
    logprobs_bt = torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets_bt, dtype=torch.long)[..., None])[..., 0]
    (-(logprobs_bt * torch.tensor(mask)).sum()).backward()
    want = {name.removeprefix("base_model.model."): (m.lora_A["default"].weight.grad.numpy(),
                                                     m.lora_B["default"].weight.grad.numpy())
            for name, m in ref.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert sorted(got) == sorted(want) and any("lm_head" in k for k in want) == ("lm_head" in targets)
    for name, (d_a, d_b) in want.items():
        for g, w in zip(got[name], (d_a, d_b)):
            assert np.abs(w).max() > 0, name
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-4 * np.abs(w).max(), err_msg=name)
