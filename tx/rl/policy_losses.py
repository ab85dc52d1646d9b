"""Device-side per-token terms (JAX, one datum at a time, so they vmap like `tx.losses` losses): the KL
estimators, the policy losses (a registry: regular, dual_clip, gspo, cispo, sapo, clip_cov, kl_cov, rollout_is,
dppo) and the critic's value loss; and their host-side companions (cov token selection, clip fractions, cispo
ratio metrics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from tx.registry import Registry
from tx.rl.arrays import check_bt, f64, masked_mean, safe_exp

# ---------------------------------------------------------------------------------------------------
# KL estimators (spec 2.4), JAX, elementwise


def _kl_k1(lp, ref):
    return lp - ref


def _kl_k2(lp, ref):
    return 0.5 * jnp.square(lp - ref)


def _kl_k3(lp, ref):
    d = jnp.clip(ref - lp, -20.0, 20.0)
    return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)


def _kl_abs(lp, ref):
    d = lp - ref
    return d * jnp.sign(d)  # |d| with torch's subgradient 0 at d = 0 (jnp.abs has 1 there)


KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "k1": _kl_k1, "k2": _kl_k2, "k3": _kl_k3, "abs": _kl_abs,
}
"""`kl_estimator_type` -> fn(logprobs, ref_logprobs), elementwise. k1 = lp - ref; k2 = (lp - ref)^2 / 2;
k3 = clip(exp(d) - d - 1, -10, 10) with d = clip(ref - lp, -20, 20) (SkyRL's clamps); abs = |lp - ref| (gradient
sign(lp - ref), 0 at lp = ref, as torch's abs)."""


def kl_estimate(kind: str, logprobs, ref_logprobs) -> jax.Array:
    """Per-token KL(policy || ref) estimate, differentiable w.r.t. `logprobs`; not masked (callers weigh
    by the mask, e.g. with `sequence_mean_weights`)."""
    if kind not in KL_ESTIMATORS:
        raise KeyError(f"unknown kl_estimator_type {kind!r}; known: {', '.join(sorted(KL_ESTIMATORS))}")
    return KL_ESTIMATORS[kind](jnp.asarray(logprobs), jnp.asarray(ref_logprobs))


# ---------------------------------------------------------------------------------------------------
# policy losses (spec 2.3), JAX, one datum at a time

PolicyLossFn = Callable[[jax.Array, Mapping[str, jax.Array], Mapping[str, jax.Array]], jax.Array]
"""fn(logprobs_t, inputs {"old_logprobs", "rollout_logprobs", "advantages", "mask", "selected"} each [t], params)
-> loss [t]"""

POLICY_LOSS_INPUT_KEYS = ("old_logprobs", "rollout_logprobs", "advantages", "mask", "selected")
"""old_logprobs: the pre-update policy's log-probs (recomputed by the trainer, or the sampler's when those are the
update's); rollout_logprobs: the sampler's (behaviour policy's) log-probs, read by rollout_is, dppo and cispo with
cispo_anchor = "rollout". A caller without separate sampler log-probs passes old_logprobs there (or leaves the key
out: `rollout_logprobs(inputs)` then reads old_logprobs, the on-policy case)."""

# where each built-in loss parameter lives in the seed config (under trainer.algorithm), SkyRL's field names
POLICY_LOSS_PARAM_FIELDS: dict[str, str] = {
    "eps_clip_low": "eps_clip_low", "eps_clip_high": "eps_clip_high", "clip_ratio_c": "clip_ratio_c",
    "cispo_eps_clip_low": "cispo.cispo_eps_clip_low", "cispo_eps_clip_high": "cispo.cispo_eps_clip_high",
    "cispo_anchor": "cispo.cispo_anchor",
    "tau_pos": "sapo.tau_pos", "tau_neg": "sapo.tau_neg",
    "clip_ratio": "clip_cov.clip_ratio", "clip_cov_lb": "clip_cov.clip_cov_lb", "clip_cov_ub": "clip_cov.clip_cov_ub",
    "kl_cov_frac": "kl_cov.kl_cov_frac", "ppo_kl_coef": "kl_cov.ppo_kl_coef",
    "dppo_type": "dppo.dppo_type", "delta_low": "dppo.delta_low", "delta_high": "dppo.delta_high",
}

# string-valued config fields, carried as the float index of the value in this tuple (params are floats)
POLICY_LOSS_PARAM_CHOICES: dict[str, tuple[str, ...]] = {
    "cispo_anchor": ("old", "rollout"),
    "dppo_type": ("binary_tv", "binary_kl"),
}

# SkyRL's LOSSES_WITHOUT_OLD_LOGPROBS: these read the sampler's log-probs (old ones only for off-policy correction)
POLICY_LOSSES_WITHOUT_OLD_LOGPROBS = frozenset({"rollout_is", "dppo"})


def policy_loss_param_value(key: str, value) -> float:
    """A config value as the float a loss reads: a choice field's string (or its index) -> its index in
    POLICY_LOSS_PARAM_CHOICES[key]; any other value -> float(value). An unknown choice raises, naming the field."""
    choices = POLICY_LOSS_PARAM_CHOICES.get(key)
    if choices is None:
        return float(value)
    if isinstance(value, str):
        if value not in choices:
            raise ValueError(f"{POLICY_LOSS_PARAM_FIELDS.get(key, key)} must be one of {', '.join(choices)}, "
                             f"got {value!r}")
        return float(choices.index(value))
    if float(value) not in range(len(choices)):
        raise ValueError(f"{POLICY_LOSS_PARAM_FIELDS.get(key, key)} must be one of {', '.join(choices)} "
                         f"(or its index), got {value!r}")
    return float(value)


def rollout_logprobs(inputs: Mapping[str, jax.Array]) -> jax.Array:
    """inputs["rollout_logprobs"], or inputs["old_logprobs"] where the caller has no separate sampler log-probs."""
    return inputs["rollout_logprobs"] if "rollout_logprobs" in inputs else inputs["old_logprobs"]


@dataclass(frozen=True)
class PolicyLossSpec:
    name: str
    fn: PolicyLossFn
    params: Mapping[str, float]  # every parameter the loss (and its host-side selection) reads, with defaults

    def resolve(self, overrides: Mapping[str, float] | None = None) -> dict[str, float]:
        """The defaults overridden by `overrides`; an unknown key raises, naming it and the loss."""
        unknown = sorted(set(overrides or {}) - set(self.params))
        if unknown:
            raise ValueError(f"policy loss {self.name!r} has no parameter {unknown[0]!r} "
                             f"(accepted: {', '.join(sorted(self.params)) or 'none'})")
        return {**self.params, **(overrides or {})}


POLICY_LOSSES: Registry[PolicyLossSpec] = Registry("policy_loss_type")
_ON_CHANGE: list[Callable[[str, PolicyLossSpec | None], None]] = []  # the device objective follows the registry


def on_policy_loss_registered(callback: Callable[[str, PolicyLossSpec | None], None]) -> None:
    """Call `callback(name, spec)` after each (re-)registration and `callback(name, None)` after each removal."""
    _ON_CHANGE.append(callback)


def register_policy_loss(name: str, fn: PolicyLossFn | None = None, *, params: Mapping[str, float] | None = None,
                         replace: bool = False):
    """Register a per-datum policy loss under `name` (decorator or plain call), selectable as
    `trainer.algorithm.policy_loss_type`. `params` lists every parameter the loss reads, with its default.
    Re-registering a name raises unless `replace=True`."""

    def add(f: PolicyLossFn) -> PolicyLossFn:
        spec = POLICY_LOSSES.register(name, PolicyLossSpec(name, f, dict(params or {})), replace=replace)
        for callback in _ON_CHANGE:
            callback(name, spec)
        return f

    return add(fn) if fn is not None else add


def unregister_policy_loss(name: str) -> None:
    POLICY_LOSSES.unregister(name)
    for callback in _ON_CHANGE:
        callback(name, None)


def policy_loss(name: str) -> PolicyLossSpec:
    return POLICY_LOSSES.get(name)


def policy_loss_names() -> tuple[str, ...]:
    return tuple(POLICY_LOSSES.names())


def _jsafe_exp(d):
    return jnp.exp(jnp.clip(d, -20.0, 20.0))


def _ppo_clipped(ratio, adv, params):
    """-min(ratio*A, clip(ratio, 1-eps_clip_low, 1+eps_clip_high)*A)."""
    clipped = jnp.clip(ratio, 1.0 - params["eps_clip_low"], 1.0 + params["eps_clip_high"])
    return -jnp.minimum(ratio * adv, clipped * adv)


_EPS = {"eps_clip_low": 0.2, "eps_clip_high": 0.2}


@register_policy_loss("regular", params=_EPS)
def regular(logprobs_t, inputs, params):
    """PPO: ratio = safe_exp(lp - old); L = -min(ratio*A, clip(ratio, 1-eps_clip_low, 1+eps_clip_high)*A)."""
    ratio = _jsafe_exp(logprobs_t - inputs["old_logprobs"])
    return _ppo_clipped(ratio, inputs["advantages"], params)


@register_policy_loss("dual_clip", params={**_EPS, "clip_ratio_c": 3.0})
def dual_clip(logprobs_t, inputs, params):
    """Dual-clip PPO: L = where(A < 0, min(-A*clip_ratio_c, L_regular), L_regular)."""
    adv = inputs["advantages"]
    loss = regular(logprobs_t, inputs, params)
    return jnp.where(adv < 0, jnp.minimum(-adv * params["clip_ratio_c"], loss), loss)


@register_policy_loss("gspo", params=_EPS)
def gspo(logprobs_t, inputs, params):
    """GSPO-token: s = masked_mean(lp - old, mask) over this datum; log r_t = min(lp_t - sg(lp_t) + sg(s), 10)
    (value s, gradient of its own lp_t); then the PPO clip with eps_clip_low/high. An empty mask gives s=0."""
    mask = inputs["mask"]
    delta = jnp.where(mask > 0, logprobs_t - inputs["old_logprobs"], 0.0)
    seq_log_ratio = jnp.sum(delta * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    lp_sg = jax.lax.stop_gradient(logprobs_t)
    log_ratio = jnp.minimum(logprobs_t - lp_sg + jax.lax.stop_gradient(seq_log_ratio), 10.0)
    return _ppo_clipped(jnp.exp(log_ratio), inputs["advantages"], params)


def _cispo_behaviour(inputs, params):
    """cispo_anchor 0 ("old"): old_logprobs; 1 ("rollout"): the sampler's log-probs."""
    return jnp.where(params["cispo_anchor"] == 1, rollout_logprobs(inputs), inputs["old_logprobs"])


@register_policy_loss("cispo", params={"cispo_eps_clip_low": 0.0, "cispo_eps_clip_high": 5.0, "cispo_anchor": 0.0})
def cispo(logprobs_t, inputs, params):
    """CISPO: w = clip(safe_exp(lp - behaviour), 1-cispo_eps_clip_low, 1+cispo_eps_clip_high);
    L = -A * sg(w) * lp (gradient -A*w through log pi only). behaviour = old_logprobs (cispo_anchor "old" = 0) or
    rollout_logprobs ("rollout" = 1; then TIS must be off, see `check_policy_loss_config`)."""
    ratio = _jsafe_exp(logprobs_t - _cispo_behaviour(inputs, params))
    w = jnp.clip(ratio, 1.0 - params["cispo_eps_clip_low"], 1.0 + params["cispo_eps_clip_high"])
    return -inputs["advantages"] * jax.lax.stop_gradient(w) * logprobs_t


@register_policy_loss("sapo", params={"tau_pos": 1.0, "tau_neg": 1.05})
def sapo(logprobs_t, inputs, params):
    """SAPO soft gate: ratio = exp(clip(lp - old, -20, 20)); tau = tau_pos if A > 0 else tau_neg;
    L = -sigmoid(tau*(ratio-1)) * 4/tau * A."""
    adv = inputs["advantages"]
    ratio = _jsafe_exp(logprobs_t - inputs["old_logprobs"])
    tau = jnp.where(adv > 0, params["tau_pos"], params["tau_neg"])
    return -jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv


@register_policy_loss("clip_cov", params={**_EPS, "clip_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0})
def clip_cov(logprobs_t, inputs, params):
    """Clip-Cov: ratio = exp(lp - old) (no clamp); L = max(-A*ratio, -A*clip(ratio, 1-eps_clip_low,
    1+eps_clip_high)) * (1 - selected); `selected` (from `select_cov_tokens`) marks the tokens whose gradient
    is cut (SkyRL's corr = 0)."""
    adv = inputs["advantages"]
    ratio = jnp.exp(logprobs_t - inputs["old_logprobs"])
    clipped = jnp.clip(ratio, 1.0 - params["eps_clip_low"], 1.0 + params["eps_clip_high"])
    return jnp.maximum(-adv * ratio, -adv * clipped) * (1.0 - inputs["selected"])


@register_policy_loss("kl_cov", params={"kl_cov_frac": 0.2, "ppo_kl_coef": 1.0})
def kl_cov(logprobs_t, inputs, params):
    """KL-Cov: ratio = exp(lp - old); L = -A*ratio, plus ppo_kl_coef*|lp - old| on `selected` tokens (the
    top-covariance tokens from `select_cov_tokens`). No PPO clip."""
    delta = logprobs_t - inputs["old_logprobs"]
    loss = -inputs["advantages"] * jnp.exp(delta)
    # |delta| with subgradient 0 at delta = 0 (torch's abs), where every token starts (lp = old)
    return jnp.where(inputs["selected"] > 0, loss + params["ppo_kl_coef"] * delta * jnp.sign(delta), loss)


@register_policy_loss("rollout_is", params=_EPS)
def rollout_is(logprobs_t, inputs, params):
    """Rollout IS (GLM-5, IcePop-style): r = safe_exp(lp - rollout); f = r if 1-eps_clip_low < r < 1+eps_clip_high
    (strict) else 0; L = -sg(f) * A * lp (gradient -f*A)."""
    ratio = _jsafe_exp(logprobs_t - rollout_logprobs(inputs))
    in_range = (ratio > 1.0 - params["eps_clip_low"]) & (ratio < 1.0 + params["eps_clip_high"])
    return -jax.lax.stop_gradient(jnp.where(in_range, ratio, 0.0)) * inputs["advantages"] * logprobs_t


def _dppo_keep(lp, behaviour_t, adv, params, xp=jnp):
    """DPPO's 0/1 mask (no gradient), p = exp(lp), mu = exp(behaviour), diff = p - mu:
    binary_tv (dppo_type 0): 0 where (A > 0 and diff > delta_high) or (A < 0 and -diff > delta_low);
    binary_kl (1): kl = mu*(log mu - lp) + (1-mu)*log((1-mu+1e-8)/(1-p+1e-8)); 0 where (A > 0, diff > 0,
    kl > delta_high) or (A < 0, diff < 0, kl > delta_low)."""
    p, mu = xp.exp(lp), xp.exp(behaviour_t)
    diff = p - mu
    tv_cut = ((adv > 0) & (diff > params["delta_high"])) | ((adv < 0) & (-diff > params["delta_low"]))
    with np.errstate(invalid="ignore", divide="ignore"):  # a log-prob > 0 (padding) only fails the comparisons
        kl = mu * (behaviour_t - lp) + (1.0 - mu) * xp.log((1.0 - mu + 1e-8) / (1.0 - p + 1e-8))
    kl_cut = (((adv > 0) & (diff > 0) & (kl > params["delta_high"]))
              | ((adv < 0) & (diff < 0) & (kl > params["delta_low"])))
    return xp.where(xp.where(params["dppo_type"] == 1, kl_cut, tv_cut), 0.0, 1.0)


@register_policy_loss("dppo", params={"dppo_type": 0.0, "delta_low": 0.2, "delta_high": 0.2})
def dppo(logprobs_t, inputs, params):
    """DPPO (binary divergence mask): behaviour = rollout_logprobs; r = safe_exp(lp - behaviour);
    L = -r * A * keep, keep from `_dppo_keep` (dppo_type 0 = "binary_tv", 1 = "binary_kl")."""
    behaviour = rollout_logprobs(inputs)
    adv = inputs["advantages"]
    ratio = _jsafe_exp(logprobs_t - behaviour)
    return -ratio * adv * _dppo_keep(jax.lax.stop_gradient(logprobs_t), behaviour, adv, params)


def select_cov_tokens(kind: Literal["clip_cov", "kl_cov"], logprobs_bt, advantages_bt, mask_bt,
                      params: Mapping[str, float], rng: np.random.Generator | None = None, *,
                      old_logprobs_bt=None) -> np.ndarray:
    """Batch-level token selection of clip_cov / kl_cov, float32 0/1 [b, t] for `inputs["selected"]`.

    Over the valid tokens (mask > 0) of the batch given, cov = (A - mean A) * (lp - mean lp):
    - clip_cov: candidates are valid tokens not clipped by PPO (the ratio exp(lp - old_logprobs_bt) with
      eps_clip_low/high; no token counts as clipped when `old_logprobs_bt` is None) with
      clip_cov_lb < cov < clip_cov_ub; min(k, #candidates) of them, k = max(int(clip_ratio * sum(mask)), 1),
      are drawn uniformly without replacement with `rng`. selected = 1: the token's loss is zeroed.
    - kl_cov: the k = max(1, int(n_valid * kl_cov_frac)) valid tokens of largest cov (ties: first in row-major
      order). selected = 1: the token gets the KL-penalised loss. `rng` is unused.

    tx selects once per optimizer mini-batch from the logprobs passed here (the trainer passes the
    pre-update `old` logprobs), while SkyRL selects per micro-batch from the current logprobs."""
    params = policy_loss(kind).resolve(params)
    lp = check_bt("logprobs_bt", f64(logprobs_bt))
    adv = check_bt("advantages_bt", f64(advantages_bt), lp.shape)
    m = check_bt("mask_bt", f64(mask_bt), lp.shape)
    valid = m > 0
    selected = np.zeros(lp.shape, np.float32)
    if kind == "clip_cov":
        if rng is None:
            raise ValueError("clip_cov token selection needs a numpy Generator (rng)")
        clipped = np.zeros(lp.shape, bool)
        if old_logprobs_bt is not None:
            ratio = np.exp(lp - check_bt("old_logprobs_bt", f64(old_logprobs_bt), lp.shape))
            bounded = np.clip(ratio, 1.0 - params["eps_clip_low"], 1.0 + params["eps_clip_high"])
            clipped = (-adv * bounded > -adv * ratio) & valid
        cov = (adv - masked_mean(adv, m)) * (lp - masked_mean(lp, m))
        cand = valid & ~clipped & (cov > params["clip_cov_lb"]) & (cov < params["clip_cov_ub"])
        flat = np.flatnonzero(cand)
        k = max(int(params["clip_ratio"] * m.sum()), 1)
        if flat.size:
            selected.flat[rng.choice(flat, size=min(k, flat.size), replace=False)] = 1.0
    elif kind == "kl_cov":
        flat = np.flatnonzero(valid)
        if flat.size:
            a, l_ = adv.reshape(-1)[flat], lp.reshape(-1)[flat]
            cov = (a - a.mean()) * (l_ - l_.mean())
            k = max(1, int(flat.size * params["kl_cov_frac"]))
            selected.flat[flat[np.argsort(-cov, kind="stable")[:k]]] = 1.0
    else:
        raise ValueError(f"select_cov_tokens: kind must be 'clip_cov' or 'kl_cov', got {kind!r}")
    return selected


def _host_ratio_inputs(name, p, logprobs_bt, old_logprobs_bt, mask_bt, rollout_logprobs_bt):
    """float64 (lp, old, behaviour, mask) of loss `name`: behaviour = the sampler's log-probs for rollout_is, dppo
    and cispo with cispo_anchor "rollout" (old_logprobs_bt when rollout_logprobs_bt is None), else old."""
    lp = check_bt("logprobs_bt", f64(logprobs_bt))
    old = check_bt("old_logprobs_bt", f64(old_logprobs_bt), lp.shape)
    m = check_bt("mask_bt", f64(mask_bt), lp.shape)
    roll = old if rollout_logprobs_bt is None else check_bt("rollout_logprobs_bt", f64(rollout_logprobs_bt), lp.shape)
    rollout_anchored = name in POLICY_LOSSES_WITHOUT_OLD_LOGPROBS or (name == "cispo" and p["cispo_anchor"] == 1)
    return lp, old, roll if rollout_anchored else old, m


def clip_fraction(name: str, logprobs_bt, old_logprobs_bt, advantages_bt, mask_bt,
                  params: Mapping[str, float] | None = None, *, selected_bt=None, rollout_logprobs_bt=None) -> float:
    """The `clip_ratio` metric of loss `name` over valid tokens (masked mean):
    regular / dual_clip / gspo: PPO clip active (-clip(r)A > -rA; gspo with its sequence ratio);
    cispo: ratio (to its anchor) outside [1-cispo_eps_clip_low, 1+cispo_eps_clip_high]; rollout_is: ratio to the
    sampler not strictly inside (1-eps_clip_low, 1+eps_clip_high); dppo: tokens its divergence mask drops;
    clip_cov: fraction of `selected_bt` (0 when not given); every other loss: 0. `rollout_logprobs_bt`: the
    sampler's log-probs (None: they are the old ones)."""
    p = policy_loss(name).resolve(params)
    lp, old, behaviour, m = _host_ratio_inputs(name, p, logprobs_bt, old_logprobs_bt, mask_bt, rollout_logprobs_bt)
    adv = check_bt("advantages_bt", f64(advantages_bt), lp.shape)
    if name in ("regular", "dual_clip", "gspo"):
        if name == "gspo":
            seq_b = masked_mean(np.where(m > 0, lp - old, 0.0), m, axis=1)
            ratio = np.broadcast_to(np.exp(np.minimum(seq_b, 10.0))[:, None], lp.shape)
        else:
            ratio = safe_exp(lp - old)
        bounded = np.clip(ratio, 1.0 - p["eps_clip_low"], 1.0 + p["eps_clip_high"])
        return float(masked_mean((-bounded * adv > -ratio * adv).astype(np.float64), m))
    if name == "cispo":
        return cispo_metrics(lp, old, m, p, rollout_logprobs_bt=rollout_logprobs_bt)["clip_ratio"]
    if name == "rollout_is":
        ratio = safe_exp(lp - behaviour)
        inside = (ratio > 1.0 - p["eps_clip_low"]) & (ratio < 1.0 + p["eps_clip_high"])
        return float(masked_mean((~inside).astype(np.float64), m))
    if name == "dppo":
        keep = _dppo_keep(lp, behaviour, adv, p, xp=np)
        return float(masked_mean((keep == 0).astype(np.float64), m))
    if name == "clip_cov" and selected_bt is not None:
        return float(masked_mean(f64(selected_bt), m))
    return 0.0


def cispo_metrics(logprobs_bt, old_logprobs_bt, mask_bt, params: Mapping[str, float] | None = None, *,
                  rollout_logprobs_bt=None) -> dict[str, float]:
    """SkyRL's cispo loss metrics, r = safe_exp(lp - behaviour) (behaviour per cispo_anchor, as the loss),
    c = clip(r, 1-cispo_eps_clip_low, 1+cispo_eps_clip_high): clip_ratio = masked mean of (r < 1-lo or r > 1+hi);
    cispo/ratio_mean, cispo/ratio_clamped_mean = masked means of r, c; cispo/ratio_max, cispo/ratio_min over the
    valid tokens (over every position when none is valid, 0 for an empty batch)."""
    p = policy_loss("cispo").resolve(params)
    _, _, behaviour, m = _host_ratio_inputs("cispo", p, logprobs_bt, old_logprobs_bt, mask_bt, rollout_logprobs_bt)
    ratio = safe_exp(f64(logprobs_bt) - behaviour)
    lo, hi = 1.0 - p["cispo_eps_clip_low"], 1.0 + p["cispo_eps_clip_high"]
    active = ratio[m > 0] if (m > 0).any() else ratio.reshape(-1)
    return {"clip_ratio": float(masked_mean(((ratio < lo) | (ratio > hi)).astype(np.float64), m)),
            "cispo/ratio_mean": float(masked_mean(ratio, m)),
            "cispo/ratio_clamped_mean": float(masked_mean(np.clip(ratio, lo, hi), m)),
            "cispo/ratio_max": float(active.max()) if active.size else 0.0,
            "cispo/ratio_min": float(active.min()) if active.size else 0.0}


def check_policy_loss_config(name: str, params: Mapping[str, float] | None, tis_ratio_type: str | None) -> None:
    """SkyRL's config checks of a policy loss: cispo with cispo_anchor "rollout" is itself the off-policy
    correction, so off_policy_correction.tis_ratio_type must be None (TIS would double-count it)."""
    p = policy_loss(name).resolve(params)
    if name == "cispo" and p["cispo_anchor"] == 1 and tis_ratio_type is not None:
        raise ValueError("trainer.algorithm.cispo.cispo_anchor='rollout' is already rollout-anchored and performs the "
                         f"off-policy correction; off_policy_correction.tis_ratio_type={tis_ratio_type!r} would "
                         "double-count it (set it to None)")


def value_loss(values_t, old_values_t, returns_t, value_clip) -> jax.Array:
    """The critic's per-token loss (PPO's clipped value loss, as SkyRL): with V' = old + clip(V - old, -c, c),
    0.5 * max((V' - R)^2, (V - R)^2); `value_clip` c <= 0 means no clipping, 0.5 * (V - R)^2. Not reduced:
    tx.rl's critic weighs it as SkyRL reduces it, each sequence's masked mean, then the mean over the mini-batch's
    sequences (`critic.value_datums`)."""
    v, old, ret = jnp.asarray(values_t), jnp.asarray(old_values_t), jnp.asarray(returns_t)
    clipped = old + jnp.clip(v - old, -value_clip, value_clip)
    unclipped = (v - ret) ** 2
    return 0.5 * jnp.where(value_clip > 0, jnp.maximum((clipped - ret) ** 2, unclipped), unclipped)


def value_clip_fraction(values_bt, old_values_bt, returns_bt, mask_bt, value_clip: float) -> float:
    """Share of valid tokens whose clipped value loss is the larger one (SkyRL's `vf_clipfrac`)."""
    if value_clip <= 0:
        return 0.0
    v, old, ret, m = (f64(x) for x in (values_bt, old_values_bt, returns_bt, mask_bt))
    clipped = old + np.clip(v - old, -value_clip, value_clip)
    return float(masked_mean(((clipped - ret) ** 2 > (v - ret) ** 2).astype(np.float64), m))
