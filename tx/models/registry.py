"""Model families by HF architecture name (registry, not a switch)."""

from __future__ import annotations

from typing import Callable, TypeVar

from flax import nnx

T = TypeVar("T", bound=type[nnx.Module])
_FAMILIES: dict[str, type[nnx.Module]] = {}


def register(*architectures: str) -> Callable[[T], T]:
    def deco(cls: T) -> T:
        for name in architectures:
            _FAMILIES[name] = cls
        return cls

    return deco


def model_class(architecture: str) -> type[nnx.Module]:
    # Import the built-in families lazily so that registering happens on first use.
    import tx.models.qwen3  # noqa: F401

    if architecture not in _FAMILIES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(_FAMILIES))}"
        )
    return _FAMILIES[architecture]
