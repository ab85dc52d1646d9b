"""Model families by HF architecture name (registry, not a switch).

The built-in families are a static table of "module:class" names, imported at first use (so this module
imports no model module, and model modules do not import it). Users add theirs with
`@register("MyForCausalLM", ...)` on a model class; registering an architecture that another class already
holds, a built-in one included, raises unless `replace=True` (a plugin overriding a built-in family says so
explicitly).
"""

from __future__ import annotations

import importlib
from typing import Callable, TypeVar

from flax import nnx

from tx.registry import Registry

T = TypeVar("T", bound=type[nnx.Module])
FAMILIES: Registry[type[nnx.Module]] = Registry("architecture")


BUILT_IN = {
    # one decoder whose layers follow the config (tx.models.decoder): Qwen3's q/k norms, Llama 3's RoPE scaling,
    # DeepSeek-V3's (and Kimi-K2's) latent attention, shared experts and grouped sigmoid routing
    "Qwen3ForCausalLM": "tx.models.decoder:DecoderLM",
    "Qwen3MoeForCausalLM": "tx.models.decoder:DecoderLM",
    "LlamaForCausalLM": "tx.models.decoder:DecoderLM",
    "DeepseekV3ForCausalLM": "tx.models.decoder:DecoderLM",
}


# HF model_type and tinker-cookbook's renderer name of each built-in architecture (reported by the service)
FAMILY_NAMES = {"Qwen3ForCausalLM": ("qwen3", "qwen3"), "Qwen3MoeForCausalLM": ("qwen3_moe", "qwen3"),
                "LlamaForCausalLM": ("llama", "llama3"), "DeepseekV3ForCausalLM": ("deepseek_v3", "deepseekv3")}


def family_names(architecture: str) -> dict[str, str | None]:
    """{"family": HF model_type, "renderer_name": the cookbook's renderer} (None for a user's architecture)."""
    family, renderer = FAMILY_NAMES.get(architecture, (None, None))
    return {"family": family, "renderer_name": renderer}


def _load_built_in() -> None:
    """Register the built-in families not registered yet (a user's earlier replacement stays)."""
    for architecture, target in BUILT_IN.items():
        if architecture not in FAMILIES:
            module, name = target.split(":")
            FAMILIES.register(architecture, getattr(importlib.import_module(module), name))


def register(*architectures: str, replace: bool = False) -> Callable[[T], T]:
    _load_built_in()  # a built-in name is taken before any user registers
    return FAMILIES.decorator(*architectures, replace=replace)


def model_class(architecture: str) -> type[nnx.Module]:
    _load_built_in()
    return FAMILIES.get(architecture)
