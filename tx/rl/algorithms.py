"""RL algorithms of SkyRLTrainConfig's `trainer.algorithm`: advantage estimators, KL estimators, policy
losses, loss reduction, off-policy correction, rollout filters and the in-reward KL controller.

Host side (numpy, float64 inside, float32 out): everything computed once per training batch or per
optimizer mini-batch from whole-batch arrays (`*_bt` = [sequences, response positions], `*_b` = per
sequence). Device side (JAX): the KL estimators and the policy losses, which see one datum (sequence) at a
time so they vmap like `tx.losses` losses.

How a trainer puts them together for one optimizer mini-batch (spec 2.3-2.5, 2.7):

    tis_bt, mask_bt, m = apply_off_policy_correction(cfg, old_bt, roll_bt, loss_mask_bt)
    w_bt = reduction_weights(loss_reduction, mask_bt, max_seq_len) * tis_bt
    loss = sum_b sum_t spec.fn(lp_t, {"old_logprobs", "advantages", "mask": loss_mask_t, "selected"}, params)
                       * w_bt + kl_loss_coef * sum(kl_estimate(kind, lp, ref) * sequence_mean_weights(mask_bt))

`mask` given to a loss is the loss mask *before* off-policy correction (gspo's sequence ratio reads it,
as SkyRL does); the correction acts through the weights. Registries (advantage estimators, policy
losses) are per process: register custom ones in a module every host imports.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np

# ---------------------------------------------------------------------------------------------------
# host helpers


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _masked_mean(x: np.ndarray, m: np.ndarray, axis=None):
    """SkyRL's masked_mean: sum(x*m) / max(sum(m), 1)."""
    return (x * m).sum(axis=axis) / np.maximum(m.sum(axis=axis), 1.0)


def _safe_exp(d: np.ndarray) -> np.ndarray:
    """SkyRL's safe_exp_delta(clip=20): exp(clip(d, -20, 20))."""
    return np.exp(np.clip(d, -20.0, 20.0))


def _check_bt(name: str, x: np.ndarray, shape: tuple[int, ...] | None = None) -> np.ndarray:
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D [sequences, positions], got shape {x.shape}")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} has shape {x.shape}, expected {shape}")
    return x


def _group_ids(group_b, n_rows: int) -> tuple[np.ndarray, int]:
    """Dense group index per row (0..G-1) and G, from any hashable ids (prompt uids)."""
    group_b = np.asarray(group_b)
    if group_b.shape != (n_rows,):
        raise ValueError(f"group_b has shape {group_b.shape}, expected ({n_rows},)")
    _, inverse = np.unique(group_b, return_inverse=True)
    inverse = inverse.reshape(-1)
    return inverse, int(inverse.max()) + 1 if n_rows else 0


def _group_all_equal(scores_b: np.ndarray, gid_b: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group: (all scores identical, group size). Exact test instead of np.std(...) == 0, which is
    ~1e-17 rather than 0 for e.g. three equal scores of 0.1."""
    hi = np.full(n_groups, -np.inf)
    lo = np.full(n_groups, np.inf)
    np.maximum.at(hi, gid_b, scores_b)
    np.minimum.at(lo, gid_b, scores_b)
    return hi == lo, np.bincount(gid_b, minlength=n_groups)


# ---------------------------------------------------------------------------------------------------
# advantage estimators (spec 2.1, 2.2)


@dataclass(frozen=True)
class EstimatorParams:
    """Estimator settings from `trainer.algorithm`: `gamma`, `lambd`, `grpo_norm_by_std`; `epsilon` is
    GRPO's std epsilon (a SkyRL function default, not a config field)."""

    gamma: float = 1.0
    lambd: float = 1.0
    grpo_norm_by_std: bool = True
    epsilon: float = 1e-6


AdvantageFn = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, EstimatorParams],
                       tuple[np.ndarray, np.ndarray]]
"""fn(token_rewards_bt, response_mask_bt, group_b, values_bt | None, params) -> (advantages_bt, returns_bt)"""

_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage_estimator(name: str, fn: AdvantageFn | None = None, *, replace: bool = False):
    """Register an estimator under `name` (`@register_advantage_estimator("name")` or a plain call).
    It becomes selectable as `trainer.algorithm.advantage_estimator`. Re-registering a name raises unless
    `replace=True`."""

    def add(f: AdvantageFn) -> AdvantageFn:
        if name in _ESTIMATORS and not replace:
            raise ValueError(f"advantage estimator {name!r} is already registered (pass replace=True to override)")
        _ESTIMATORS[name] = f
        return f

    return add(fn) if fn is not None else add


def advantage_estimator(name: str) -> AdvantageFn:
    if name not in _ESTIMATORS:
        raise KeyError(f"unknown advantage_estimator {name!r}; registered: {', '.join(sorted(_ESTIMATORS))}")
    return _ESTIMATORS[name]


def advantage_estimator_names() -> tuple[str, ...]:
    return tuple(sorted(_ESTIMATORS))


def compute_advantages(name: str, token_rewards_bt, response_mask_bt, group_b, values_bt=None,
                       params: EstimatorParams = EstimatorParams()) -> tuple[np.ndarray, np.ndarray]:
    """Run estimator `name` on float64 copies of the inputs; returns float32 (advantages_bt, returns_bt)."""
    r = _check_bt("token_rewards_bt", _f64(token_rewards_bt))
    m = _check_bt("response_mask_bt", _f64(response_mask_bt), r.shape)
    v = None if values_bt is None else _check_bt("values_bt", _f64(values_bt), r.shape)
    adv, ret = advantage_estimator(name)(r, m, np.asarray(group_b), v, params)
    return _f32(adv), _f32(ret)


def _masked_whiten(x_bt: np.ndarray, m_bt: np.ndarray) -> np.ndarray:
    """SkyRL masked_whiten: (x - mean) / sqrt(var + 1e-8), mean and Bessel-corrected var over m."""
    n = m_bt.sum()
    if n < 2:
        raise ValueError(f"cannot whiten advantages over {n:g} valid response tokens (need at least 2)")
    mean = (x_bt * m_bt).sum() / n
    var = ((x_bt - mean) ** 2 * m_bt).sum() / n * (n / (n - 1))
    return (x_bt - mean) / np.sqrt(var + 1e-8)


@register_advantage_estimator("grpo")
def grpo(token_rewards_bt, response_mask_bt, group_b, values_bt, params):
    """score_b = sum_t r; per group g: adv = (score - mean_g) / (std_g + epsilon) with the unbiased std
    (or score - mean_g when grpo_norm_by_std=False); a singleton group uses mean 0, std 1.
    A = adv_b * response_mask; returns = A."""
    scores_b = _f64(token_rewards_bt).sum(axis=1)
    gid_b, n_groups = _group_ids(group_b, scores_b.shape[0])
    count_g = np.bincount(gid_b, minlength=n_groups).astype(np.float64)
    mean_g = np.bincount(gid_b, weights=scores_b, minlength=n_groups) / np.maximum(count_g, 1.0)
    sq_g = np.bincount(gid_b, weights=(scores_b - mean_g[gid_b]) ** 2, minlength=n_groups)
    std_g = np.sqrt(sq_g / np.maximum(count_g - 1.0, 1.0))
    single_b = count_g[gid_b] == 1
    mean_b = np.where(single_b, 0.0, mean_g[gid_b])
    std_b = np.where(single_b, 1.0, std_g[gid_b])
    adv_b = scores_b - mean_b
    if params.grpo_norm_by_std:
        adv_b = adv_b / (std_b + params.epsilon)
    adv_bt = _f32(adv_b[:, None] * _f64(response_mask_bt))
    return adv_bt, adv_bt.copy()


@register_advantage_estimator("rloo")
def rloo(token_rewards_bt, response_mask_bt, group_b, values_bt, params):
    """Leave-one-out baseline: adv = (score - mean_g) * n/(n-1) for a group of n > 1 (= score minus the
    mean of the others); a singleton group gets 0 (with a warning). A = adv_b * response_mask; returns = A."""
    scores_b = _f64(token_rewards_bt).sum(axis=1)
    gid_b, n_groups = _group_ids(group_b, scores_b.shape[0])
    count_g = np.bincount(gid_b, minlength=n_groups).astype(np.float64)
    mean_g = np.bincount(gid_b, weights=scores_b, minlength=n_groups) / np.maximum(count_g, 1.0)
    n_b = count_g[gid_b]
    if (n_b == 1).any():
        warnings.warn("rloo: a group with one sample has no leave-one-out baseline; its advantage is 0",
                      RuntimeWarning, stacklevel=2)
    adv_b = np.where(n_b > 1, (scores_b - mean_g[gid_b]) * n_b / np.maximum(n_b - 1.0, 1.0), 0.0)
    adv_bt = _f32(adv_b[:, None] * _f64(response_mask_bt))
    return adv_bt, adv_bt.copy()


@register_advantage_estimator("reinforce++")
def reinforce_pp(token_rewards_bt, response_mask_bt, group_b, values_bt, params):
    """Discounted return-to-go G (reset outside the response mask), whitened over the whole batch:
    A = masked_whiten(G, R) * R; returns = G. Uses `gamma`."""
    r = _f64(token_rewards_bt)
    m = _f64(response_mask_bt)
    returns_bt = np.zeros_like(r)
    running_b = np.zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        running_b = r[:, t] + params.gamma * running_b
        returns_bt[:, t] = running_b
        running_b = running_b * m[:, t]
    return _f32(_masked_whiten(returns_bt, m) * m), _f32(returns_bt)


@register_advantage_estimator("gae")
def gae(token_rewards_bt, response_mask_bt, group_b, values_bt, params):
    """Generalised advantage estimation with the critic's values V (`gamma`, `lambd`):
    delta_t = r_t + gamma V_{t+1} - V_t (V_T = 0), A_t = delta_t + gamma lambd A_{t+1};
    returns = A + V; advantages = masked_whiten(A, R). As in SkyRL the recursion runs over padded
    positions unmasked and the whitened advantages are not re-masked, so pass V = 0 on padding."""
    if values_bt is None:
        raise ValueError("advantage_estimator 'gae' needs critic values (values_bt is None)")
    r = _f64(token_rewards_bt)
    v = _f64(values_bt)
    adv_bt = np.zeros_like(r)
    last_b = np.zeros(r.shape[0])
    n_t = r.shape[1]
    for t in range(n_t - 1, -1, -1):
        next_b = v[:, t + 1] if t < n_t - 1 else 0.0
        last_b = r[:, t] + params.gamma * next_b - v[:, t] + params.gamma * params.lambd * last_b
        adv_bt[:, t] = last_b
    returns_bt = adv_bt + v
    return _f32(_masked_whiten(adv_bt, _f64(response_mask_bt))), _f32(returns_bt)


def batch_normalize_advantages(advantages_bt, mask_bt) -> np.ndarray:
    """`advantage_batch_normalize` (masked variant, spec 2.2): mu, var = masked mean / variance over the
    whole batch; A = where(M > 0, A - mu, 0) / sqrt(max(var, 1e-8))."""
    a = _check_bt("advantages_bt", _f64(advantages_bt))
    m = _check_bt("mask_bt", _f64(mask_bt), a.shape)
    mu = _masked_mean(a, m)
    var = _masked_mean((a - mu) ** 2, m)
    return _f32(np.where(m > 0, a - mu, 0.0) / np.sqrt(max(var, 1e-8)))


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
    return jnp.abs(lp - ref)


KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "k1": _kl_k1, "k2": _kl_k2, "k3": _kl_k3, "abs": _kl_abs,
}
"""`kl_estimator_type` -> fn(logprobs, ref_logprobs), elementwise. k1 = lp - ref; k2 = (lp - ref)^2 / 2;
k3 = clip(exp(d) - d - 1, -10, 10) with d = clip(ref - lp, -20, 20) (SkyRL's clamps); abs = |lp - ref|."""


def kl_estimate(kind: str, logprobs, ref_logprobs) -> jax.Array:
    """Per-token KL(policy || ref) estimate, differentiable w.r.t. `logprobs`; not masked (callers weigh
    by the mask, e.g. with `sequence_mean_weights`)."""
    if kind not in KL_ESTIMATORS:
        raise KeyError(f"unknown kl_estimator_type {kind!r}; known: {', '.join(sorted(KL_ESTIMATORS))}")
    return KL_ESTIMATORS[kind](jnp.asarray(logprobs), jnp.asarray(ref_logprobs))


# ---------------------------------------------------------------------------------------------------
# policy losses (spec 2.3), JAX, one datum at a time

PolicyLossFn = Callable[[jax.Array, Mapping[str, jax.Array], Mapping[str, jax.Array]], jax.Array]
"""fn(logprobs_t, inputs {"old_logprobs", "advantages", "mask", "selected"} each [t], params) -> loss [t]"""

POLICY_LOSS_INPUT_KEYS = ("old_logprobs", "advantages", "mask", "selected")

# where each built-in loss parameter lives in the seed config (under trainer.algorithm)
POLICY_LOSS_PARAM_FIELDS: dict[str, str] = {
    "eps_clip_low": "eps_clip_low", "eps_clip_high": "eps_clip_high", "clip_ratio_c": "clip_ratio_c",
    "cispo_eps_clip_low": "cispo.cispo_eps_clip_low", "cispo_eps_clip_high": "cispo.cispo_eps_clip_high",
    "tau_pos": "sapo.tau_pos", "tau_neg": "sapo.tau_neg",
    "clip_ratio": "clip_cov.clip_ratio", "clip_cov_lb": "clip_cov.clip_cov_lb", "clip_cov_ub": "clip_cov.clip_cov_ub",
    "kl_cov_frac": "kl_cov.kl_cov_frac", "ppo_kl_coef": "kl_cov.ppo_kl_coef",
}


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


_POLICY_LOSSES: dict[str, PolicyLossSpec] = {}
_ON_POLICY_LOSS: list[Callable[[], None]] = []  # called after each registration (the device objective follows)


def on_policy_loss_registered(callback: Callable[[], None]) -> None:
    _ON_POLICY_LOSS.append(callback)


def register_policy_loss(name: str, fn: PolicyLossFn | None = None, *, params: Mapping[str, float] | None = None,
                         replace: bool = False):
    """Register a per-datum policy loss under `name` (decorator or plain call), selectable as
    `trainer.algorithm.policy_loss_type`. `params` lists every parameter the loss reads, with its default.
    Re-registering a name raises unless `replace=True`."""

    def add(f: PolicyLossFn) -> PolicyLossFn:
        if name in _POLICY_LOSSES and not replace:
            raise ValueError(f"policy loss {name!r} is already registered (pass replace=True to override)")
        _POLICY_LOSSES[name] = PolicyLossSpec(name, f, dict(params or {}))
        for callback in _ON_POLICY_LOSS:
            callback()
        return f

    return add(fn) if fn is not None else add


def policy_loss(name: str) -> PolicyLossSpec:
    if name not in _POLICY_LOSSES:
        raise KeyError(f"unknown policy_loss_type {name!r}; registered: {', '.join(sorted(_POLICY_LOSSES))}")
    return _POLICY_LOSSES[name]


def policy_loss_names() -> tuple[str, ...]:
    return tuple(sorted(_POLICY_LOSSES))


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


@register_policy_loss("cispo", params={"cispo_eps_clip_low": 0.0, "cispo_eps_clip_high": 5.0})
def cispo(logprobs_t, inputs, params):
    """CISPO: w = clip(safe_exp(lp - old), 1-cispo_eps_clip_low, 1+cispo_eps_clip_high);
    L = -A * sg(w) * lp (gradient -A*w through log pi only)."""
    ratio = _jsafe_exp(logprobs_t - inputs["old_logprobs"])
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
    return jnp.where(inputs["selected"] > 0, loss + params["ppo_kl_coef"] * jnp.abs(delta), loss)


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
    lp = _check_bt("logprobs_bt", _f64(logprobs_bt))
    adv = _check_bt("advantages_bt", _f64(advantages_bt), lp.shape)
    m = _check_bt("mask_bt", _f64(mask_bt), lp.shape)
    valid = m > 0
    selected = np.zeros(lp.shape, np.float32)
    if kind == "clip_cov":
        if rng is None:
            raise ValueError("clip_cov token selection needs a numpy Generator (rng)")
        clipped = np.zeros(lp.shape, bool)
        if old_logprobs_bt is not None:
            ratio = np.exp(lp - _check_bt("old_logprobs_bt", _f64(old_logprobs_bt), lp.shape))
            bounded = np.clip(ratio, 1.0 - params["eps_clip_low"], 1.0 + params["eps_clip_high"])
            clipped = (-adv * bounded > -adv * ratio) & valid
        cov = (adv - _masked_mean(adv, m)) * (lp - _masked_mean(lp, m))
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


def clip_fraction(name: str, logprobs_bt, old_logprobs_bt, advantages_bt, mask_bt,
                  params: Mapping[str, float] | None = None, *, selected_bt=None) -> float:
    """The `clip_ratio` metric of loss `name` over valid tokens (masked mean):
    regular / dual_clip / gspo: PPO clip active (-clip(r)A > -rA; gspo with its sequence ratio);
    cispo: ratio outside [1-cispo_eps_clip_low, 1+cispo_eps_clip_high]; clip_cov: fraction of `selected_bt`
    (0 when not given); every other loss: 0."""
    p = policy_loss(name).resolve(params)
    lp = _check_bt("logprobs_bt", _f64(logprobs_bt))
    old = _check_bt("old_logprobs_bt", _f64(old_logprobs_bt), lp.shape)
    adv = _check_bt("advantages_bt", _f64(advantages_bt), lp.shape)
    m = _check_bt("mask_bt", _f64(mask_bt), lp.shape)
    if name in ("regular", "dual_clip", "gspo"):
        if name == "gspo":
            seq_b = _masked_mean(np.where(m > 0, lp - old, 0.0), m, axis=1)
            ratio = np.broadcast_to(np.exp(np.minimum(seq_b, 10.0))[:, None], lp.shape)
        else:
            ratio = _safe_exp(lp - old)
        bounded = np.clip(ratio, 1.0 - p["eps_clip_low"], 1.0 + p["eps_clip_high"])
        return float(_masked_mean((-bounded * adv > -ratio * adv).astype(np.float64), m))
    if name == "cispo":
        ratio = _safe_exp(lp - old)
        out = (ratio < 1.0 - p["cispo_eps_clip_low"]) | (ratio > 1.0 + p["cispo_eps_clip_high"])
        return float(_masked_mean(out.astype(np.float64), m))
    if name == "clip_cov" and selected_bt is not None:
        return float(_masked_mean(_f64(selected_bt), m))
    return 0.0


def value_loss(values_t, old_values_t, returns_t, value_clip) -> jax.Array:
    """The critic's per-token loss (PPO's clipped value loss, as SkyRL): with V' = old + clip(V - old, -c, c),
    0.5 * max((V' - R)^2, (V - R)^2); `value_clip` c <= 0 means no clipping, 0.5 * (V - R)^2. Not reduced:
    callers weigh it by the masked token mean over the mini-batch."""
    v, old, ret = jnp.asarray(values_t), jnp.asarray(old_values_t), jnp.asarray(returns_t)
    clipped = old + jnp.clip(v - old, -value_clip, value_clip)
    unclipped = (v - ret) ** 2
    return 0.5 * jnp.where(value_clip > 0, jnp.maximum((clipped - ret) ** 2, unclipped), unclipped)


def value_clip_fraction(values_bt, old_values_bt, returns_bt, mask_bt, value_clip: float) -> float:
    """Share of valid tokens whose clipped value loss is the larger one (SkyRL's `vf_clipfrac`)."""
    if value_clip <= 0:
        return 0.0
    v, old, ret, m = (_f64(x) for x in (values_bt, old_values_bt, returns_bt, mask_bt))
    clipped = old + np.clip(v - old, -value_clip, value_clip)
    return float(_masked_mean(((clipped - ret) ** 2 > (v - ret) ** 2).astype(np.float64), m))


# ---------------------------------------------------------------------------------------------------
# loss reduction (spec 2.5) as per-token weights

LOSS_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")


def reduction_weights(kind: str, mask_bt, max_seq_len: int | None = None) -> np.ndarray:
    """Per-token weights w with sum(L * w) = the `loss_reduction` of L over the given batch (the optimizer
    mini-batch of Bm rows; pass every row of it, fully masked ones included):
    token_mean: M / max(sum M, 1); sequence_mean: M / (Bm * max(sum_t M, 1));
    seq_mean_token_sum_norm (Dr. GRPO): M / (Bm * max_seq_len)."""
    m = _check_bt("mask_bt", _f64(mask_bt))
    n_rows = max(m.shape[0], 1)
    if kind == "token_mean":
        return _f32(m / max(m.sum(), 1.0))
    if kind == "sequence_mean":
        return _f32(m / np.maximum(m.sum(axis=1, keepdims=True), 1.0) / n_rows)
    if kind == "seq_mean_token_sum_norm":
        if max_seq_len is None or max_seq_len <= 0:
            raise ValueError(f"loss_reduction 'seq_mean_token_sum_norm' needs a positive max_seq_len, got {max_seq_len!r}")
        return _f32(m / (n_rows * float(max_seq_len)))
    raise ValueError(f"unknown loss_reduction {kind!r}; expected one of {', '.join(LOSS_REDUCTIONS)}")


def sequence_mean_weights(mask_bt) -> np.ndarray:
    """Weights of the KL loss term, always a sequence mean: mean_b(masked_mean(kl, M, axis=-1))."""
    return reduction_weights("sequence_mean", mask_bt)


# ---------------------------------------------------------------------------------------------------
# off-policy correction (spec 2.7)


@dataclass(frozen=True)
class OffPolicyCorrection:
    """`trainer.algorithm.off_policy_correction` (seed names and defaults). The IS ratio is
    rho = exp(old - rollout) per token (old = pre-update policy, rollout = sampler)."""

    tis_ratio_type: Literal["token", "sequence"] | None = None
    token_tis_ratio_clip_high: float = 2.0
    sequence_tis_ratio_clip_high: float = 5.0
    sequence_mask_metric: Literal["product", "geometric"] | None = None
    geo_mask_high: float = 1.01
    geo_mask_low: float = 0.99
    product_mask_high: float = 2.0
    product_mask_low: float = 0.5
    outlier_token_is_threshold_low: float | None = None
    outlier_token_is_threshold_high: float | None = None
    token_mask_is_threshold_low: float | None = None
    token_mask_is_threshold_high: float | None = None

    def __post_init__(self):
        if self.tis_ratio_type not in (None, "token", "sequence"):
            raise ValueError(f"off_policy_correction.tis_ratio_type must be None, 'token' or 'sequence', "
                             f"got {self.tis_ratio_type!r}")
        if self.sequence_mask_metric not in (None, "product", "geometric"):
            raise ValueError(f"off_policy_correction.sequence_mask_metric must be None, 'product' or 'geometric', "
                             f"got {self.sequence_mask_metric!r}")
        if (self.token_mask_is_threshold_low is None) != (self.token_mask_is_threshold_high is None):
            raise ValueError("off_policy_correction.token_mask_is_threshold_low and token_mask_is_threshold_high "
                             f"must be set together, got {self.token_mask_is_threshold_low!r} and "
                             f"{self.token_mask_is_threshold_high!r}")

    @property
    def outlier_enabled(self) -> bool:
        return self.outlier_token_is_threshold_low is not None or self.outlier_token_is_threshold_high is not None

    @property
    def token_mask_enabled(self) -> bool:
        return self.token_mask_is_threshold_low is not None

    @property
    def enabled(self) -> bool:
        return (self.tis_ratio_type is not None or self.sequence_mask_metric is not None
                or self.outlier_enabled or self.token_mask_enabled)


def apply_off_policy_correction(cfg: OffPolicyCorrection, old_logprobs_bt, rollout_logprobs_bt, mask_bt
                                ) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """(tis_weights_bt, new mask_bt, metrics), no gradient, in SkyRL's order, rho = safe_exp(old - rollout):
    1. outlier rows: drop a row with any valid token rho > outlier_token_is_threshold_high or rho < ..._low;
    2. token mask: M *= (token_mask_is_threshold_low <= rho <= token_mask_is_threshold_high);
    3. TIS weight with the updated M: token: min(rho, token_tis_ratio_clip_high); sequence (per row):
       min(safe_exp(sum_t d*M), sequence_tis_ratio_clip_high), d = old - rollout;
    4. sequence mask: geometric g = safe_exp(sum_t d*M / max(sum_t M, 1)) kept iff geo_mask_low <= g <=
       geo_mask_high; product p = safe_exp(sum_t d*M) kept iff product_mask_low <= p <= product_mask_high.
    Nothing enabled: (ones, mask unchanged, {}). Metrics: is_ratio_{mean,std,max,min} over the valid tokens
    of the input mask; row fractions for the row masks; fractions of valid tokens for token-level ones."""
    m = _check_bt("mask_bt", _f64(mask_bt))
    if not cfg.enabled:
        return np.ones(m.shape, np.float32), _f32(m), {}
    old = _check_bt("old_logprobs_bt", _f64(old_logprobs_bt), m.shape)
    roll = _check_bt("rollout_logprobs_bt", _f64(rollout_logprobs_bt), m.shape)
    d = old - roll
    rho = _safe_exp(d)
    n_rows = max(m.shape[0], 1)
    valid_rho = rho[m > 0]
    metrics: dict[str, float] = {}
    if valid_rho.size:
        metrics.update(is_ratio_mean=float(valid_rho.mean()), is_ratio_std=float(valid_rho.std()),
                       is_ratio_max=float(valid_rho.max()), is_ratio_min=float(valid_rho.min()))
    else:
        metrics.update(is_ratio_mean=0.0, is_ratio_std=0.0, is_ratio_max=0.0, is_ratio_min=0.0)

    if cfg.outlier_enabled:
        lo, hi = cfg.outlier_token_is_threshold_low, cfg.outlier_token_is_threshold_high
        over_b = ((rho > hi) & (m > 0)).any(axis=1) if hi is not None else np.zeros(m.shape[0], bool)
        under_b = ((rho < lo) & (m > 0)).any(axis=1) if lo is not None else np.zeros(m.shape[0], bool)
        drop_b = over_b | under_b
        m = m * ~drop_b[:, None]
        metrics.update(outlier_seq_masked_ratio=drop_b.sum() / n_rows, outlier_seq_over_high_ratio=over_b.sum() / n_rows,
                       outlier_seq_under_low_ratio=under_b.sum() / n_rows)

    if cfg.token_mask_enabled:
        valid = m > 0
        n_valid = max(valid.sum(), 1)
        under = (rho < cfg.token_mask_is_threshold_low) & valid
        over = (rho > cfg.token_mask_is_threshold_high) & valid
        m = m * ~(under | over)
        metrics.update(token_mask_masked_ratio=(under | over).sum() / n_valid,
                       token_mask_under_low_ratio=under.sum() / n_valid, token_mask_over_high_ratio=over.sum() / n_valid)

    seq_log_b = (d * m).sum(axis=1)
    tis = np.ones(m.shape)
    if cfg.tis_ratio_type == "token":
        cap = cfg.token_tis_ratio_clip_high
        tis = np.minimum(rho, cap)
        metrics["tis_token_clip_high_ratio"] = ((rho > cap) & (m > 0)).sum() / max((m > 0).sum(), 1)
    elif cfg.tis_ratio_type == "sequence":
        cap = cfg.sequence_tis_ratio_clip_high
        seq_b = _safe_exp(seq_log_b)
        tis = np.broadcast_to(np.minimum(seq_b, cap)[:, None], m.shape)
        metrics["tis_seq_clip_high_ratio"] = (seq_b > cap).sum() / n_rows

    if cfg.sequence_mask_metric is not None:
        if cfg.sequence_mask_metric == "geometric":
            prefix, lo, hi = "geo", cfg.geo_mask_low, cfg.geo_mask_high
            value_b = _safe_exp(seq_log_b / np.maximum(m.sum(axis=1), 1.0))
        else:
            prefix, lo, hi = "product", cfg.product_mask_low, cfg.product_mask_high
            value_b = _safe_exp(seq_log_b)
        over_b, under_b = value_b > hi, value_b < lo
        m = m * ~(over_b | under_b)[:, None]
        metrics.update({f"{prefix}_sequence_mask_masked_ratio": (over_b | under_b).sum() / n_rows,
                        f"{prefix}_sequence_mask_over_high_ratio": over_b.sum() / n_rows,
                        f"{prefix}_sequence_mask_under_low_ratio": under_b.sum() / n_rows})
    return _f32(tis), _f32(m), {k: float(v) for k, v in metrics.items()}


# ---------------------------------------------------------------------------------------------------
# rollout filters (spec 2.6) and KL in reward (spec 2.4)


def zero_variance_mask(scores_b, group_b) -> np.ndarray:
    """`zero_variance_filter`: False for every row of a group (size > 1) whose scores are all equal
    (population std 0); singletons are kept. tx applies it to score_b = sum_t r, token-level rewards too."""
    s = _f64(scores_b).reshape(-1)
    gid_b, n_groups = _group_ids(group_b, s.shape[0])
    equal_g, count_g = _group_all_equal(s, gid_b, n_groups)
    return ~(equal_g & (count_g > 1))[gid_b]


def dynamic_sampling_filter(scores_b, group_b, n_samples: int) -> np.ndarray:
    """`dynamic_sampling`: True for the rows of "good" groups, those whose scores are not all equal
    (std > 0), or every row when n_samples_per_prompt == 1."""
    s = _f64(scores_b).reshape(-1)
    if n_samples == 1:
        return np.ones(s.shape[0], bool)
    gid_b, n_groups = _group_ids(group_b, s.shape[0])
    equal_g, _ = _group_all_equal(s, gid_b, n_groups)
    return ~equal_g[gid_b]


class KLController:
    """`trainer.algorithm.kl_ctrl` for use_kl_in_reward; `value` is the current beta (initially
    kl_loss_coef). fixed: constant. adaptive (Ziegler et al.): after each step,
    beta *= 1 + clip(current_kl / kl_target - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, kind: Literal["fixed", "adaptive"] = "fixed", init_coef: float = 0.001,
                 kl_target: float = 0.1, horizon: int = 10000):
        if kind not in ("fixed", "adaptive"):
            raise ValueError(f"kl_ctrl.type must be 'fixed' or 'adaptive', got {kind!r}")
        if kind == "adaptive":
            if horizon <= 0:
                raise ValueError(f"kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon!r}")
            if kl_target <= 0:
                raise ValueError(f"kl_ctrl.kl_target must be > 0 for the adaptive controller, got {kl_target!r}")
        self.kind, self.kl_target, self.horizon = kind, float(kl_target), horizon
        self.value = float(init_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """n_steps = sequences in the training batch (SkyRL)."""
        if self.kind == "adaptive":
            err = min(max(float(current_kl) / self.kl_target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + err * n_steps / self.horizon


def apply_kl_in_reward(token_rewards_bt, kl_bt, mask_bt, coef: float) -> tuple[np.ndarray, float]:
    """use_kl_in_reward: kl = kl_bt * M (kl_bt = k(old, ref)); r -= max(0, coef) * kl;
    returns (rewards_bt, current_kl = mean_b(masked_mean(kl, M, axis=-1))), current_kl being `loss/avg_kl`."""
    r = _check_bt("token_rewards_bt", _f64(token_rewards_bt))
    m = _check_bt("mask_bt", _f64(mask_bt), r.shape)
    kl = _check_bt("kl_bt", _f64(kl_bt), r.shape) * m
    current = float(_masked_mean(kl, m, axis=1).mean()) if r.shape[0] else 0.0
    return _f32(r - max(0.0, float(coef)) * kl), current


__all__ = [
    "EstimatorParams", "AdvantageFn", "register_advantage_estimator", "advantage_estimator",
    "advantage_estimator_names", "compute_advantages", "batch_normalize_advantages",
    "KL_ESTIMATORS", "kl_estimate",
    "PolicyLossFn", "PolicyLossSpec", "POLICY_LOSS_INPUT_KEYS", "POLICY_LOSS_PARAM_FIELDS",
    "register_policy_loss", "policy_loss", "policy_loss_names", "select_cov_tokens", "clip_fraction", "value_loss",
    "value_clip_fraction",
    "LOSS_REDUCTIONS", "reduction_weights", "sequence_mean_weights",
    "OffPolicyCorrection", "apply_off_policy_correction",
    "zero_variance_mask", "dynamic_sampling_filter", "KLController", "apply_kl_in_reward",
]
