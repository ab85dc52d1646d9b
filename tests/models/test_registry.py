"""The model-family registry (tx.models.registry on tx.registry.Registry): a second registration of an
architecture is an error unless replace=True; unknown names list what is registered."""

import pytest
from flax import nnx

from tx.models.decoder import DecoderLM
from tx.models.registry import FAMILIES, family_names, model_class, register
from tx.registry import Registry


class _A(nnx.Module):
    pass


class _B(nnx.Module):
    pass


@pytest.fixture
def scratch_name():
    yield "TestOnlyForCausalLM"
    if "TestOnlyForCausalLM" in FAMILIES:
        FAMILIES.unregister("TestOnlyForCausalLM")


def test_duplicate_architecture_is_refused_unless_replace(scratch_name):
    register(scratch_name)(_A)
    register(scratch_name)(_A)  # the same class again (a module run twice): harmless
    with pytest.raises(ValueError, match=rf"architecture '{scratch_name}' is already registered \(to "
                                         rf"{__name__}\._A\); pass replace=True to replace it with {__name__}\._B"):
        register(scratch_name)(_B)
    assert model_class(scratch_name) is _A
    register(scratch_name, replace=True)(_B)
    assert model_class(scratch_name) is _B


def test_builtin_family_is_not_silently_replaced(scratch_name):
    with pytest.raises(ValueError, match="architecture 'Qwen3ForCausalLM' is already registered"):
        register(scratch_name, "Qwen3ForCausalLM")(_A)
    assert model_class("Qwen3ForCausalLM") is DecoderLM
    assert scratch_name not in FAMILIES  # all or nothing: no name was taken


def test_unknown_name_lists_the_registered():
    reg = Registry("widget")
    with pytest.raises(ValueError, match=r"unknown widget 'x'; registered: \(none\)"):
        reg.get("x")
    reg.register("b", 1)
    reg.register("a", 2)
    with pytest.raises(ValueError, match="unknown widget 'x'; registered: a, b"):
        reg.get("x")
    assert list(reg) == ["a", "b"] and len(reg) == 2 and "a" in reg


@pytest.mark.parametrize("spec", [dict(family="qwen3"), dict(family="qwen3", moe=True), dict(family="llama"),
                                  dict(family="deepseek_v3"), dict(family="deepseek_v3", q_lora_rank=0)],
                         ids=["qwen3", "qwen3_moe", "llama", "deepseek_v3", "deepseek_v3_q_proj"])
def test_every_built_in_family_builds_a_causal_lm(spec):
    """Each built-in architecture, dispatched from its config.json, builds a model with the interface the rest of
    tx calls (tx.models.family.CausalLM), whose paged cache layout matches its attention."""
    from tx.models.config import LoraSlots, ModelConfig
    from tx.models.family import CausalLM
    from tx.models.loading import build_abstract
    from tx.models.tiny import TinySpec, hf_config

    hf = hf_config(TinySpec(**spec))
    cfg = ModelConfig.from_hf_dict(hf)
    # what get_server_capabilities reports: the HF model_type and tinker-cookbook's renderer of the family
    renderers = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "llama": "llama3", "deepseek_v3": "deepseekv3"}
    assert family_names(cfg.architecture) == {"family": hf["model_type"], "renderer_name": renderers[hf["model_type"]]}
    model = build_abstract(cfg, LoraSlots(max_lora_adapters=2, max_lora_rank=2), platform="cpu")
    assert isinstance(model, CausalLM) and type(model) is model_class(cfg.architecture)
    pools = model.kv_layout()
    if cfg.mla is None:
        assert [shape for shape, _ in pools] == [(cfg.num_key_value_heads, cfg.head_dim)] * 2
    else:
        assert [shape for shape, _ in pools] == [(1, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)]
    assert model.kv_bytes_per_token() == cfg.num_hidden_layers * sum(a * b for (a, b), _ in pools) * 4
