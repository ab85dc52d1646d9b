"""Llama 3 (`LlamaForCausalLM`): the Qwen3 decoder without query/key norms, with Llama 3.1's RoPE scaling, against
transformers' own Llama on checkpoints transformers wrote (`save_pretrained`): RoPE frequencies bit-identical,
log-probs beyond the original context (1e-4, float32), LoRA training through the backend against PEFT, greedy
paged sampling == `generate`."""

import json

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import tx
from tests.helpers import assert_logprobs_match_hf, peft_model_of, train_and_check_two_adapters
from tx.models.config import ModelConfig
from tx.models.layers.rope import inv_freq
from tx.models.loading import load_model
from tx.models.tiny import TinySpec, write_tiny_model

TOL = 1e-4
# Llama 3.1 8B's and 3.2 1B's RoPE (head_dim 128, theta 500000)
ROPES = {"3.1": (8.0, 1.0, 4.0, 8192), "3.2": (32.0, 1.0, 4.0, 8192)}


@pytest.mark.parametrize("version", sorted(ROPES))
def test_llama3_rope_frequencies_are_bit_identical_to_transformers(version):
    factor, low, high, original = ROPES[version]
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=rope)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = inv_freq(128, 500000.0, ROPES[version])
    np.testing.assert_array_equal(got, want.numpy())
    assert not np.array_equal(got, inv_freq(128, 500000.0))  # the scaling changed something


def _llama(tmp_path, tie: bool):
    """A random Llama 3.2-style model written by transformers: GQA, llama3 RoPE with a short original context
    (64 tokens, so the scaled frequencies matter within the test's sequences), tied or untied embeddings."""
    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_parameters=rope, tie_word_embeddings=tie, initializer_range=0.2, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    out = tmp_path / f"llama-{'tied' if tie else 'untied'}"
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    return {tie: _llama(root, tie) for tie in (False, True)}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logprobs_match_transformers_beyond_the_original_context(llama_dirs, tie):
    model_dir = llama_dirs[tie]
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.architecture == "LlamaForCausalLM" and not cfg.qk_norm and cfg.llama3_rope.factor == 8.0
    assert cfg.tie_word_embeddings == tie and cfg.head_dim == 16 and cfg.num_key_value_heads == 2
    model = load_model(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert_logprobs_match_hf(model, hf, 3, [150, 40], tol=TOL)


def test_config_refuses_what_llama_checkpoints_do_not_have(llama_dirs):
    hf = json.loads((llama_dirs[False] / "config.json").read_text())
    with pytest.raises(ValueError, match="mlp_bias=true is not supported"):
        ModelConfig.from_hf_dict({**hf, "mlp_bias": True})
    rope = hf.get("rope_parameters") or hf.get("rope_scaling")
    with pytest.raises(ValueError, match="rope_type='llama3' needs low_freq_factor"):
        ModelConfig.from_hf_dict({**hf, "rope_parameters": {k: v for k, v in rope.items() if k != "low_freq_factor"},
                                  "rope_scaling": None})


def test_lora_training_matches_peft_and_greedy_sampling_matches_generate(llama_dirs):
    """Two adapters trained in one backend; each adapter's forward equals PEFT with its weights; greedy paged
    sampling through an adapter equals transformers' generate on the PEFT model."""
    model_dir = str(llama_dirs[False])
    backend = tx.JaxBackend(model_dir, tx.JaxBackendConfig(max_lora_adapters=3, max_lora_rank=8, max_seq_len=96))
    train_and_check_two_adapters(backend, model_dir, peft_model_of, TOL)


def test_sharded_over_8_devices_equals_one_device(llama_dirs):
    """The (fsdp, ep, tp) sharding rules hold for Llama too: with two adapters, log-probs on 8 CPU devices equal
    one device's (the mesh shapes of the Qwen3 test)."""
    from tests.models.test_sharding import MESHES, _run
    from tx.models.sharding import make_mesh

    _, want = _run(str(llama_dirs[False]), make_mesh(devices=jax.devices()[:1]))
    for shape in MESHES:
        _, got = _run(str(llama_dirs[False]), make_mesh(*shape))
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"mesh {shape}")


def test_tx_written_llama_checkpoint_matches_transformers(tmp_path):
    """`tx.models.tiny` with family="llama" (what the benchmarks' --family llama writes) is a checkpoint
    transformers loads as its own Llama: the same config and the same log-probs as tx's model (1e-4)."""
    spec = TinySpec(family="llama", llama3_rope=True, max_position_embeddings=1024, init_std=0.2, seed=5)
    model_dir = write_tiny_model(tmp_path / "llama", spec)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert isinstance(hf, LlamaForCausalLM) and hf.config.rope_parameters["rope_type"] == "llama3"
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.architecture == "LlamaForCausalLM" and not cfg.qk_norm and cfg.llama3_rope.factor == 8.0
    model = load_model(model_dir)
    assert_logprobs_match_hf(model, hf, 6, [300, 64], tol=TOL)
    with pytest.raises(ValueError, match="moe=True needs family='qwen3'"):
        TinySpec(family="llama", moe=True)
    with pytest.raises(ValueError, match="llama3_rope=True needs family='llama'"):
        TinySpec(llama3_rope=True)
