"""Loading: sharded safetensors, bf16, and clear errors for a missing tensor, a wrong shape, an unknown
architecture and a bad path."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import hf_logprobs, random_batch
from tests.models.jit_logprobs import logprobs
from tx.models.loading import CheckpointError, load_model
from tx.models.safetensors_io import SafetensorsDir, save_file
from tx.models.tiny import TinySpec, write_tiny_model


def _rewrite(model_dir, edit):
    """Rewrite the single-file checkpoint with `edit(tensors)` applied."""
    files = SafetensorsDir(model_dir)
    tensors = {k: np.array(files.get(k)) for k in files.keys()}
    del files
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors")


@pytest.fixture
def dense_copy(tiny_dirs, tmp_path):
    return shutil.copytree(tiny_dirs["dense"], tmp_path / "m")


def test_missing_tensor(dense_copy):
    _rewrite(dense_copy, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(dense_copy)


def test_wrong_shape(dense_copy):
    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:100]

    _rewrite(dense_copy, shrink)
    with pytest.raises(CheckpointError, match=r"stacked tensors have different shapes"):
        load_model(dense_copy)

    def shrink_all(t):
        for i in range(2):
            t[f"model.layers.{i}.mlp.up_proj.weight"] = t[f"model.layers.{i}.mlp.up_proj.weight"][:100]

    _rewrite(dense_copy, shrink_all)
    with pytest.raises(CheckpointError, match=r"mlp\.up_proj\.kernel: checkpoint gives shape \(2, 64, 100\) but config\.json implies \(2, 64, 128\)"):
        load_model(dense_copy)


def test_unknown_architecture_and_bad_paths(dense_copy, tmp_path):
    cfg = json.loads((dense_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (dense_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type 'qwen3' but architectures\\[0\\] 'GPT2LMHeadModel'"):
        load_model(dense_copy)
    model_type = cfg.pop("model_type")  # without one, the architecture alone picks the family
    (dense_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown architecture 'GPT2LMHeadModel'; registered: DeepseekV3ForCausalLM, "
                                         "LlamaForCausalLM, Qwen3ForCausalLM"):
        load_model(dense_copy)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path / "empty")
    cfg["architectures"], cfg["model_type"] = ["Qwen3ForCausalLM"], model_type
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    (dense_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_type='dynamic' is not supported"):
        load_model(dense_copy)


def test_bf16_checkpoint_loads_as_bf16(tmp_path):
    """A bf16 checkpoint keeps bf16 base weights; log-probs stay float32 and agree with transformers'
    bf16 model to bf16 precision (both differ from exact math by rounding of activations)."""
    model_dir = write_tiny_model(tmp_path / "bf16", TinySpec(dtype="bfloat16", seed=9))
    model = load_model(model_dir)
    assert model.embed_tokens.embedding.get_value().dtype == jnp.bfloat16
    assert model.stacks[0].layer.self_attn.q_proj.lora_a.get_value().dtype == jnp.float32
    ids, mask, targets = random_batch(2, [10, 6], 512)
    got = np.asarray(logprobs(model, ids, mask, jnp.zeros(2, jnp.int32), targets))
    assert got.dtype == np.float32
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # upcast bf16 weights: exact math
    want = hf_logprobs(hf, ids, mask, targets)
    err = np.abs(got - want)[mask.astype(bool)]
    # bf16 activations carry ~3 significant digits through 2 layers; log-probs of ~-6 move by ~0.05
    assert err.max() < 0.15 and err.mean() < 0.05


def _unused_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "were not used" in r.getMessage()]


def test_unused_checkpoint_tensors_are_named_in_one_warning(dense_copy, caplog):
    """Extra tensors (here 2 layers more than config.json has, 22 tensors) are listed once: the first 10
    names and the count; a rotary inv_freq buffer is not listed."""
    def add_layers(t):
        for i in (2, 3):
            for name in [k for k in list(t) if k.startswith("model.layers.0.")]:
                t[name.replace("layers.0.", f"layers.{i}.")] = t[name]
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)

    _rewrite(dense_copy, add_layers)
    with caplog.at_level("WARNING"):
        load_model(dense_copy)
    (msg,) = _unused_warnings(caplog)
    extra = sorted(f"model.layers.{i}.{n}" for i in (2, 3) for n in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", *(f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "q_norm", "k_norm"))))
    assert msg == (f"Some weights of the model checkpoint at {dense_copy} were not used when loading "
                   f"Qwen3ForCausalLM (22 tensors): {', '.join(extra[:10])}, ...")


def test_no_unused_warning_for_a_clean_or_tied_checkpoint(tiny_dirs, tmp_path, caplog):
    """A tied model's checkpoint may carry lm_head.weight (the embedding matrix again): not a warning."""
    tied = shutil.copytree(tiny_dirs["dense_tied_mha"], tmp_path / "tied")
    _rewrite(tied, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    with caplog.at_level("WARNING"):
        load_model(tiny_dirs["moe"])
        load_model(tied)
    assert _unused_warnings(caplog) == []


def test_lora_factors_are_xlas_buffers_so_slot_writes_update_them_in_place(tiny_dirs, monkeypatch):
    """The loaded model's zero LoRA factors are made by XLA, never wrapped from numpy: with every `np.zeros`
    64-byte aligned (jax on CPU wraps such an array without copying, and a wrapped buffer cannot be donated),
    writing an adapter's slot (`put_slot`, which donates the factors) still updates every one in place."""
    import jax
    from flax import nnx

    from tests.helpers import aligned_zeros
    from tx.backends.steps import put_slot, take_slot
    from tx.models.config import LoraSlots
    from tx.models.layers.lora import LoraA, LoraB

    with monkeypatch.context() as patch:
        patch.setattr(np, "zeros", aligned_zeros)
        model = load_model(tiny_dirs["dense"], LoraSlots(max_lora_adapters=3, max_lora_rank=4))
    lora = nnx.state(model, nnx.Any(LoraA, LoraB))
    before = [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(lora)]
    assert len(before) > 10
    after = put_slot(lora, jax.tree.map(jnp.ones_like, take_slot(lora, jnp.int32(1))), jnp.int32(1))
    assert [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(after)] == before
    assert all(float(np.asarray(leaf).sum()) > 0 for leaf in jax.tree.leaves(after))
