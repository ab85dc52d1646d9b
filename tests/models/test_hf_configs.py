"""Checkpoints as transformers itself writes them (4.x and 5.x key spellings, defaults) load in tx with the
same architecture transformers reads, and give the same log-probs."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tests.helpers import hf_logprobs, random_batch
from tx.models.config import ModelConfig
from tx.models.loading import CheckpointError, load_model

TOL = 1e-4  # as in test_qwen3_parity

SIZES = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}


def _as_transformers_reads(d: dict) -> dict:
    """What transformers' config class makes of the dict `d` (the independent reference)."""
    hf = AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k != "model_type"})
    experts = getattr(hf, "num_experts", 0) if d["model_type"] == "qwen3_moe" else 0
    return {
        "hidden_size": hf.hidden_size, "num_hidden_layers": hf.num_hidden_layers, "vocab_size": hf.vocab_size,
        "num_key_value_heads": hf.num_key_value_heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        "rope_theta": hf.rope_parameters["rope_theta"], "num_experts": experts,
        "max_position_embeddings": hf.max_position_embeddings, "tie_word_embeddings": hf.tie_word_embeddings,
        **({"norm_topk_prob": hf.norm_topk_prob, "num_experts_per_tok": hf.num_experts_per_tok,
            "moe_intermediate_size": hf.moe_intermediate_size, "decoder_sparse_step": hf.decoder_sparse_step,
            "mlp_only_layers": tuple(hf.mlp_only_layers)} if experts else {}),
    }


CONFIGS = {
    # what transformers 5 writes: num_local_experts, rope_parameters
    "moe_5x": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **SIZES,
               "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
               "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}},
    # what transformers 4.x writes: num_experts, rope_theta and rope_scaling at the top level
    "moe_4x": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **SIZES, **MOE,
               "rope_theta": 1e6, "rope_scaling": None, "head_dim": 16, "norm_topk_prob": True,
               "mlp_only_layers": [1]},
    # keys left out: transformers' Qwen3MoeConfig defaults (norm_topk_prob False, head_dim derived, ...)
    "moe_minimal": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
                    "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2},
    "moe_defaults_only": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]},
    # Qwen3Config: head_dim 128 and num_key_value_heads 32 when missing (not derived from hidden_size)
    "dense_minimal": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64},
    "dense_4x": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **SIZES, "head_dim": 8,
                 "rope_theta": 20000.0, "tie_word_embeddings": True, "num_key_value_heads": None},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_reads_like_transformers(name):
    d = CONFIGS[name]
    cfg = ModelConfig.from_hf_dict(json.loads(json.dumps(d)))
    want = _as_transformers_reads(d)
    assert {k: getattr(cfg, k) for k in want} == want


@pytest.mark.parametrize("edit, message", [
    ({"num_local_experts": 0}, "needs experts"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "model_type 'qwen3_moe' but architectures[0] 'Qwen3ForCausalLM'"),
    ({"num_local_experts": 4, "num_experts": 8}, "different expert counts"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "rope_type='longrope' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' needs original_max_position_embeddings"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type='linear'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
])
def test_config_refusals_name_the_key(edit, message):
    d = {**CONFIGS["moe_5x"], **edit}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        ModelConfig.from_hf_dict(d)


def test_dense_config_refusals():
    with pytest.raises(ValueError, match="is dense, but config.json gives 4 experts"):
        ModelConfig.from_hf_dict({**CONFIGS["dense_minimal"], "num_experts": 4})
    # a missing num_key_value_heads is 32 to transformers too, which 4 heads cannot share
    with pytest.raises(ValueError, match="num_attention_heads=4 is not a multiple of num_key_value_heads=32"):
        ModelConfig.from_hf_dict({**CONFIGS["dense_minimal"], "num_attention_heads": 4})


def _save(tmp_path, moe: bool, spelling: str):
    torch.manual_seed(0)
    if moe:
        config = Qwen3MoeConfig(**SIZES, **MOE, head_dim=8, rope_parameters={"rope_theta": 1000.0, "rope_type": "default"},
                                mlp_only_layers=[0], initializer_range=0.2)
        hf = Qwen3MoeForCausalLM(config)
        with torch.no_grad():  # peaky routing, so that top-k and its normalisation matter
            for layer in hf.model.layers[1:]:
                layer.mlp.gate.weight.normal_(0, 2.0)
    else:
        config = Qwen3Config(**SIZES, head_dim=8, rope_parameters={"rope_theta": 1000.0, "rope_type": "default"},
                             initializer_range=0.2)
        hf = Qwen3ForCausalLM(config)
    out = tmp_path / f"{'moe' if moe else 'dense'}-{spelling}"
    hf.save_pretrained(out)
    if spelling == "4x":  # rewrite config.json the way transformers 4.x spells it
        path = out / "config.json"
        d = json.loads(path.read_text())
        if "num_local_experts" in d:
            d["num_experts"] = d.pop("num_local_experts")
        d["rope_theta"] = d.pop("rope_parameters")["rope_theta"]
        d["rope_scaling"] = None
        path.write_text(json.dumps(d))
    return out


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("spelling", ["5x", "4x"])
def test_save_pretrained_checkpoint_matches_transformers(tmp_path, moe, spelling):
    model_dir = _save(tmp_path, moe, spelling)
    if moe:
        assert "num_local_experts" in json.loads((model_dir / "config.json").read_text()) or spelling == "4x"
    model = load_model(model_dir)
    assert model.config.num_experts == (4 if moe else 0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, mask, targets = random_batch(3, [11, 6], SIZES["vocab_size"])
    hidden = model(jnp.asarray(ids), jnp.asarray(mask), jnp.zeros(2, jnp.int32))
    got = np.asarray(model.target_logprobs(hidden, jnp.asarray(targets), jnp.zeros(2, jnp.int32)))
    want = hf_logprobs(hf, ids, mask, targets)
    valid = mask.astype(bool)
    assert np.abs(got - want)[valid].max() <= TOL
    assert np.abs(want[valid] - want[valid].mean()).max() > 1e-2  # the model is not trivially uniform


def test_dense_config_over_moe_tensors_names_the_cause(tmp_path):
    model_dir = _save(tmp_path, True, "5x")
    path = model_dir / "config.json"
    d = json.loads(path.read_text())
    d.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    del d["num_local_experts"]
    path.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="expert tensors but config.json describes a dense model"):
        load_model(model_dir)
