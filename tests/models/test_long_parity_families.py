"""Llama 3 and DeepSeek-V3 at 4,096 tokens against transformers + PEFT, float32, at released layer shapes (two
layers): Llama-3.2-1B's (GQA 32/8 heads of 64, Llama 3.1 RoPE scaling, tied embeddings) and DeepSeek-V2-Lite's
attention (16 heads, a 512 latent, 128 + 64 RoPE query/key dims, 128 value dims; YaRN as DeepSeek-V3's) with a
dense layer then an MoE layer. Opt-in like Qwen3's (`TX_LONG_PARITY=1`; tests/models/test_long_parity.py): minutes
and several GB on a CPU. The tiny-shape parity of both families runs in CI (tests/models/test_llama.py,
tests/models/test_deepseek_v3.py)."""

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.helpers import peft_weights
from tests.models.test_long_parity import LONG_4K, _peft_logprobs, _tx_logprobs
from tx.models.adapters import set_adapter_weights
from tx.models.config import LoraSlots
from tx.models.loading import load_model

TOL = 1e-4
RANK, ALPHA = 16, 32
VOCAB = 32_000


def _llama_3_2_1b_layers(path) -> tuple[str, list[str]]:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                      rope_parameters=rope, tie_word_embeddings=True, initializer_range=0.05, attn_implementation="sdpa")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    return str(path), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def _deepseek_v2_lite_attention(path) -> tuple[str, list[str]]:
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=1408,
                           num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
                           n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                           kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                           max_position_embeddings=163840, rope_parameters=yarn, initializer_range=0.02,
                           attn_implementation="sdpa")
    # initializer_range: transformers' default (DeepSeek-V3's own is 0.006); at Llama's 0.05 this model's logits span
    # 30 nats and its float32 noise alone (no adapter) reaches 8e-5 at every position, not only late ones
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    # PEFT on every attention projection and the LM head (it retargets gate/up/down to the fused expert tensors)
    return str(path), ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "lm_head"]


@pytest.mark.slow
@LONG_4K
@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_4k_logprobs_match_transformers_peft(tmp_path, family):
    """One row of 4,096 tokens, a rank-16 adapter in slot 1."""
    build = {"llama": _llama_3_2_1b_layers, "deepseek_v3": _deepseek_v2_lite_attention}[family]
    model_dir, targets = build(tmp_path / family)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    peft = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, init_lora_weights=False))
    ids = np.random.default_rng(4096).integers(0, VOCAB, 4096)
    want = _peft_logprobs(peft, ids)
    model = load_model(model_dir, LoraSlots(max_lora_adapters=2, max_lora_rank=RANK))
    set_adapter_weights(model, 1, peft_weights(peft), alpha=ALPHA, rank=RANK)
    del peft, base
    got = _tx_logprobs(model, ids, slot=1)
    err = np.abs(got - want)
    assert err.max() <= TOL, f"{family}: max |tx - transformers+PEFT| = {err.max():.2e} at {err.argmax()}"
