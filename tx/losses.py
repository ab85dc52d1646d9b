"""Loss functions by name: Tinker's built-ins and `register()` for your own.

A loss is a JAX function of one datum (row):

    loss_fn(target_logprobs[t], inputs: {"weights", "logprobs", "advantages"} -> [t], config: {key: scalar}) -> [t]

returning the per-token loss. The server sums it over tokens and datums (Tinker's semantics: no
averaging; clients normalise through weights / advantages). One batch may mix losses and configs per
row. Register a custom loss in a module imported on every host (the registry is per process, and every
host must compile the same program):

    import tx

    @tx.losses.register("weighted_ce", config_defaults={"scale": 1.0})
    def weighted_ce(target_logprobs, inputs, config):
        return -config["scale"] * target_logprobs * inputs["weights"]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

LossFn = Callable[[jax.Array, Mapping[str, jax.Array], Mapping[str, jax.Array]], jax.Array]
INPUT_KEYS = ("weights", "logprobs", "advantages")


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: LossFn
    config_defaults: Mapping[str, float]


_REGISTRY: dict[str, LossSpec] = {}


def register(name: str, fn: LossFn | None = None, *, config_defaults: Mapping[str, float] | None = None,
             replace: bool = False):
    """Register `fn` under `name` (use as `@register("name")` or `register("name", fn)`).

    `config_defaults` lists every `loss_fn_config` key the loss accepts, with its default; requests with
    other keys are rejected. Re-registering a name raises unless `replace=True`."""

    def add(f: LossFn) -> LossFn:
        if name in _REGISTRY and not replace:
            raise ValueError(f"loss {name!r} is already registered (pass replace=True to override)")
        _REGISTRY[name] = LossSpec(name, f, dict(config_defaults or {}))
        return f

    return add(fn) if fn is not None else add


def get(name: str) -> LossSpec:
    if name not in _REGISTRY:
        raise KeyError(f"unknown loss function {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def config_keys() -> tuple[str, ...]:
    return tuple(sorted({k for spec in _REGISTRY.values() for k in spec.config_defaults}))


def resolve_config(name: str, config: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's defaults overridden by `config`; unknown keys raise, naming the key and the loss."""
    spec = get(name)
    unknown = sorted(set(config or {}) - set(spec.config_defaults))
    if unknown:
        allowed = ", ".join(sorted(spec.config_defaults)) or "none"
        raise ValueError(f"loss_fn_config key {unknown[0]!r} is not accepted by loss {name!r} (accepted: {allowed})")
    return {**spec.config_defaults, **(config or {})}


def per_token_losses(
    target_logprobs_bt: jax.Array,
    inputs_bt: Mapping[str, jax.Array],
    loss_index_b: jax.Array,
    config_bk: jax.Array,
    loss_names: tuple[str, ...],
    keys: tuple[str, ...],
) -> jax.Array:
    """Each row's own loss (`loss_names[loss_index_b[b]]`, config row `config_bk[b]` over `keys`), [b, t].

    Every loss is evaluated on every row, but rows that do not use it see all-zero inputs, so a loss
    that is not selected can never put inf / NaN into the gradient of a row that does not use it."""
    total_bt = jnp.zeros_like(target_logprobs_bt)
    for i, name in enumerate(loss_names):
        spec = get(name)
        on_b = loss_index_b == i
        keep = lambda x: jnp.where(on_b[:, None], x, 0.0)  # noqa: E731
        config = {k: config_bk[:, j] for j, k in enumerate(keys)}
        row_fn = lambda tlp, inp, cfg, f=spec.fn: f(tlp, inp, cfg)  # noqa: E731
        loss_bt = jax.vmap(row_fn)(keep(target_logprobs_bt), {k: keep(v) for k, v in inputs_bt.items()}, config)
        total_bt = jnp.where(on_b[:, None], loss_bt, total_bt)
    return total_bt


def _ratio(tlp: jax.Array, inputs: Mapping[str, jax.Array]) -> jax.Array:
    return jnp.exp(tlp - inputs["logprobs"])


@register("cross_entropy")
def cross_entropy(tlp, inputs, config):
    """Supervised learning: `-tlp * weights` (tlp = log p of the target token)."""
    return -tlp * inputs["weights"]


@register("importance_sampling")
def importance_sampling(tlp, inputs, config):
    """REINFORCE with an importance weight: `-exp(tlp - sampling_logprobs) * advantages`."""
    return -_ratio(tlp, inputs) * inputs["advantages"]


@register("ppo", config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
def ppo(tlp, inputs, config):
    """Clipped surrogate: `-min(r * A, clip(r, low, high) * A)`, r = exp(tlp - sampling_logprobs)."""
    ratio = _ratio(tlp, inputs)
    clipped = jnp.clip(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    advantages = inputs["advantages"]
    return -jnp.minimum(ratio * advantages, clipped * advantages)


@register("cispo", config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0})
def cispo(tlp, inputs, config):
    """Clipped IS-weighted policy gradient: `-stop_gradient(clip(r, low, high)) * tlp * A`."""
    coeff = jax.lax.stop_gradient(jnp.clip(_ratio(tlp, inputs), config["clip_low_threshold"], config["clip_high_threshold"]))
    return -coeff * tlp * inputs["advantages"]


@register("dro", config_defaults={"beta": 0.05})
def dro(tlp, inputs, config):
    """Quadratic-penalty off-policy objective: `-(tlp * A - 0.5 * beta * (tlp - sampling_logprobs)^2)`."""
    return -(tlp * inputs["advantages"] - 0.5 * config["beta"] * (tlp - inputs["logprobs"]) ** 2)
