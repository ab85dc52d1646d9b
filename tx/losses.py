"""Loss functions by name: Tinker's built-ins and `register()` for your own.

A loss is a JAX function of one datum (row):

    loss_fn(target_logprobs[t], inputs: {"weights", "logprobs", "advantages", "sequence_ratio_mask"} -> [t],
            config: {key: scalar}) -> [t]

returning the per-token loss. A loss may also read per-token float inputs of its own, declared with
`input_keys` (e.g. a reference policy's log-probs for a KL term): they reach `inputs` under those names
(zeros where a datum leaves them out), travel as `loss_fn_inputs` of that name through the API and as
`all_extra_inputs` in-process, and a datum that sends a key its loss does not declare is refused. A loss
registered with `needs_entropy=True` also gets `inputs["entropy"]` (each position's entropy), one with
`needs_values=True` `inputs["values"]` (a per-adapter scalar value head: an RL critic); both come back per
datum in the outputs. A loss registered with `multi_target=True` also takes 2-D `[t, K]` targets
(K target tokens per position, e.g. top-k distillation): it then sees `target_logprobs` and `weights` as
`[t, K]` and may return `[t, K]`, which is summed over K. Other losses see column 0 only (the server refuses
2-D targets for them). One row is one datum, so a sequence-level reduction inside a loss (gspo) is a
reduction over that datum alone. The server sums it over tokens and datums (Tinker's semantics: no
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
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from tx.registry import Registry

LossFn = Callable[[jax.Array, Mapping[str, jax.Array], Mapping[str, jax.Array]], jax.Array]
INPUT_KEYS = ("weights", "logprobs", "advantages", "sequence_ratio_mask")
AUX_INPUTS = ("entropy", "values")  # computed by the pass only for losses that ask (needs_entropy / needs_values)


@dataclass(frozen=True, repr=False)
class LossSpec:
    name: str
    fn: LossFn
    config_defaults: Mapping[str, float]
    multi_target: bool = False
    input_keys: tuple[str, ...] = ()  # extra per-token float inputs it reads
    needs_entropy: bool = False  # reads inputs["entropy"]: each position's entropy, with its gradient
    check: Callable[[Mapping[str, float]], None] | None = None  # raises ValueError on a bad config
    needs_values: bool = False  # reads inputs["values"]: the row's adapter's value head V [t], with its gradient
    needs_logprobs: bool = True  # False: never reads target_logprobs (a critic's loss), so passes of only such
    #                              rows skip the LM head (target_logprobs are zeros there, not returned)

    def __repr__(self) -> str:  # what a registry error names
        return f"{getattr(self.fn, '__module__', '?')}.{getattr(self.fn, '__qualname__', repr(self.fn))}"

    @property
    def aux(self) -> tuple[str, ...]:
        """The per-position quantities the pass computes for this loss (and returns per datum)."""
        return tuple(k for k, on in (("entropy", self.needs_entropy), ("values", self.needs_values)) if on)


_LOSSES: Registry[LossSpec] = Registry("loss function")
_VERSION = [0]  # bumped on every register: compiled passes key on it, so a replaced loss is re-traced


def register(name: str, fn: LossFn | None = None, *, config_defaults: Mapping[str, float] | None = None,
             replace: bool = False, multi_target: bool = False, input_keys: Sequence[str] = (),
             needs_entropy: bool = False, check: Callable[[Mapping[str, float]], None] | None = None,
             needs_values: bool = False, needs_logprobs: bool = True):
    """Register `fn` under `name` (use as `@register("name")` or `register("name", fn)`).

    `config_defaults` lists every `loss_fn_config` key the loss accepts, with its default; requests with
    other keys are rejected. `multi_target` says the loss accepts 2-D `[t, K]` targets (see the module
    docstring). `input_keys` names the extra per-token float inputs the loss reads. `needs_entropy` asks the
    training pass for `inputs["entropy"]`, the entropy of each position's next-token distribution (computed
    from the same logits chunks as the log-probs, differentiable; only in passes with such a loss's rows).
    `needs_values` asks for `inputs["values"]`: V(s) per position from the row's adapter's scalar value head on
    the final hidden states (an RL critic; zero at init, trained by this loss's gradient). `needs_logprobs=False`
    says the loss never reads `target_logprobs`: a pass whose rows all use such losses skips the LM head over
    the vocabulary, and their datums return no "logprobs".
    `check(config)` may refuse a resolved config the defaults cannot express (raise ValueError naming the key
    and value): the request then fails alone. Re-registering a name raises unless `replace=True`."""
    for key in input_keys:
        if not key.isidentifier() or key in INPUT_KEYS or key == "target_tokens":
            raise ValueError(f"loss {name!r}: input key {key!r} must be an identifier other than "
                             f"target_tokens and {', '.join(INPUT_KEYS)}")

    def add(f: LossFn) -> LossFn:
        _LOSSES.register(name, LossSpec(name, f, dict(config_defaults or {}), multi_target, tuple(input_keys),
                                        needs_entropy, check, needs_values, needs_logprobs), replace=replace)
        _VERSION[0] += 1
        return f

    return add(fn) if fn is not None else add


def unregister(name: str) -> None:
    _LOSSES.unregister(name)
    _VERSION[0] += 1


def get(name: str) -> LossSpec:
    return _LOSSES.get(name)


def names() -> tuple[str, ...]:
    return tuple(_LOSSES.names())


def version() -> int:
    """Changes whenever a loss is (re-)registered: part of every compiled pass's cache key."""
    return _VERSION[0]


def config_keys(loss_names: Sequence[str] | None = None) -> tuple[str, ...]:
    """The `loss_fn_config` keys of these losses (default: every registered one), sorted: a pass's config
    columns."""
    specs = [get(n) for n in (names() if loss_names is None else loss_names)]
    return tuple(sorted({k for spec in specs for k in spec.config_defaults}))


def extra_input_keys(loss_names: Sequence[str] | None = None) -> tuple[str, ...]:
    """Every extra per-token input key these losses (default: every registered one) read; a pass's batch
    carries these."""
    specs = [get(n) for n in (names() if loss_names is None else loss_names)]
    return tuple(sorted({k for spec in specs for k in spec.input_keys}))


def resolve_config(name: str, config: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's defaults overridden by `config`; unknown keys raise, naming the key and the loss."""
    spec = get(name)
    unknown = sorted(set(config or {}) - set(spec.config_defaults))
    if unknown:
        allowed = ", ".join(sorted(spec.config_defaults)) or "none"
        raise ValueError(f"loss_fn_config key {unknown[0]!r} is not accepted by loss {name!r} (accepted: {allowed})")
    resolved = {**spec.config_defaults, **(config or {})}
    if spec.check is not None:
        spec.check(resolved)
    return resolved


def per_token_losses(
    target_logprobs_btk: jax.Array,
    inputs_bt: Mapping[str, jax.Array],
    loss_index_b: jax.Array,
    config_bk: jax.Array,
    loss_names: tuple[str, ...],
    keys: tuple[str, ...],
) -> jax.Array:
    """Each row's own loss (`loss_names[loss_index_b[b]]`, config row `config_bk[b]` over `keys`), [b, t].

    `loss_names` are the losses of this pass's rows (the backend compiles one pass per set of losses present
    in a call), and only those are evaluated. `target_logprobs_btk` and `inputs_bt["weights"]` carry K target
    columns ([b, t, K]; 1-D rows use column 0 and weigh the others 0; [b, t] means K = 1); every other input,
    extra keys included, is [b, t] (missing = zeros).

    With several losses each is evaluated on every row, but rows that do not use it see all-zero inputs, so a
    loss that is not selected can never put inf / NaN into the gradient of a row that does not use it."""
    if target_logprobs_btk.ndim == 2:  # one target per position
        target_logprobs_btk = target_logprobs_btk[..., None]
    b_t = target_logprobs_btk.shape[:2]
    zero_keys = INPUT_KEYS + extra_input_keys(loss_names) + AUX_INPUTS  # aux: only passes that need them compute them
    inputs_bt = {k: jnp.zeros(b_t, target_logprobs_btk.dtype) for k in zero_keys} | dict(inputs_bt)
    if inputs_bt["weights"].ndim == 2:
        inputs_bt["weights"] = inputs_bt["weights"][..., None]
    config = {k: config_bk[:, j] for j, k in enumerate(keys)}
    total_bt = jnp.zeros(b_t, target_logprobs_btk.dtype)
    for i, name in enumerate(loss_names):
        spec = get(name)
        on_b = loss_index_b == i

        def keep(x, on_b=on_b):
            if len(loss_names) == 1:  # every real row uses it; padding rows are zeros and masked later
                return x
            return jnp.where(on_b.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0)

        tlp = target_logprobs_btk if spec.multi_target else target_logprobs_btk[..., 0]
        inputs = {k: keep(v if k != "weights" or spec.multi_target else v[..., 0]) for k, v in inputs_bt.items()}
        row_fn = lambda tlp, inp, cfg, f=spec.fn: f(tlp, inp, cfg)  # noqa: E731
        loss = jax.vmap(row_fn)(keep(tlp), inputs, config)
        loss_bt = loss.sum(axis=tuple(range(2, loss.ndim)))
        total_bt = loss_bt if len(loss_names) == 1 else jnp.where(on_b[:, None], loss_bt, total_bt)
    return total_bt


def _ratio(tlp: jax.Array, inputs: Mapping[str, jax.Array]) -> jax.Array:
    return jnp.exp(tlp - inputs["logprobs"])


@register("cross_entropy", multi_target=True)
def cross_entropy(tlp, inputs, config):
    """Supervised learning: `-tlp * weights` (tlp = log p of the target token). With 2-D targets
    (Tinker's top-k distillation form) the per-token loss is `-sum_k weights[t, k] * tlp[t, k]`."""
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


@register("gspo", config_defaults={"clip_low_threshold": 1.0 - 3e-4, "clip_high_threshold": 1.0 + 4e-4})
def gspo(tlp, inputs, config):
    """GSPO-token (Zheng et al. 2025, arXiv:2507.18071; formula as on Tinker's GSPO page,
    tinker-docs.thinkingmachines.ai/tinker/losses/gspo): the sequence log-ratio is the mean of
    `sg(tlp) - sampling_logprobs` over the tokens `sequence_ratio_mask` marks (of this datum only); every
    token's ratio carries that value with the gradient of its own log-prob,
    `r_t = exp(log_ratio + tlp - sg(tlp))`, in a PPO-style clipped objective `-min(r_t A_t, clip(r_t) A_t)`.
    Defaults are the paper's clip ranges (1 - 3e-4, 1 + 4e-4); an empty mask means a ratio of 1."""
    mask = (inputs["sequence_ratio_mask"] != 0).astype(tlp.dtype)
    tlp_sg = jax.lax.stop_gradient(tlp)
    log_ratio = jnp.sum(mask * (tlp_sg - inputs["logprobs"])) / jnp.maximum(jnp.sum(mask), 1.0)
    ratio = jnp.exp(log_ratio + tlp - tlp_sg)
    clipped = jnp.clip(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    advantages = inputs["advantages"]
    return -jnp.minimum(ratio * advantages, clipped * advantages)


@register("stable_reinforce", config_defaults={"kl_coeff": 0.0, "clip_high_threshold": 2.0})
def stable_reinforce(tlp, inputs, config):
    """tx's StableReinforce. Tinker documents the loss's inputs (provenance naming sequences sampled with
    `record_stability_info=True`) and its `kl_coeff` config key, but not its formula; this one is tx's
    own, in that spirit: a REINFORCE gradient with a truncated importance weight and a quadratic penalty,
    both taken against the sampler's own log-probs `q` as the server recorded them (not the client's):

        loss_t = -sg(min(exp(tlp - q), clip_high_threshold)) * A_t * tlp_t + kl_coeff * 0.5 * (tlp_t - q_t)^2

    on the positions backed by a recorded sampled token (`sequence_ratio_mask` != 0, set by the server
    from the provenance spans); elsewhere (prompt positions) the weight is 1 and there is no penalty."""
    recorded = inputs["sequence_ratio_mask"] != 0
    delta = jnp.where(recorded, tlp - inputs["logprobs"], 0.0)
    weight = jax.lax.stop_gradient(jnp.minimum(jnp.exp(delta), config["clip_high_threshold"]))
    return -weight * inputs["advantages"] * tlp + config["kl_coeff"] * 0.5 * delta**2
