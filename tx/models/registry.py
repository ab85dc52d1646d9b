"""Model families by HF architecture name (registry, not a switch).

`@register("Qwen3ForCausalLM", ...)` on a model class; registering an architecture that another class
already holds raises unless `replace=True` (a plugin overriding a built-in family says so explicitly).
"""

from __future__ import annotations

from typing import Callable, TypeVar

from flax import nnx

from tx.registry import Registry

T = TypeVar("T", bound=type[nnx.Module])
FAMILIES: Registry[type[nnx.Module]] = Registry("architecture")


def register(*architectures: str, replace: bool = False) -> Callable[[T], T]:
    return FAMILIES.decorator(*architectures, replace=replace)


def model_class(architecture: str) -> type[nnx.Module]:
    # Import the built-in families lazily so that registering happens on first use.
    import tx.models.qwen3  # noqa: F401

    return FAMILIES.get(architecture)
