"""Advantage estimators (a registry: grpo, rloo, maxrl, reinforce++, gae), batch normalisation, the rollout filters
(zero variance, dynamic sampling) and the KL in the reward with its fixed / adaptive controller; host side
(numpy, float64 inside, float32 out) over whole-batch `*_bt` / `*_b` arrays."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np

from tx.registry import Registry
from tx.rl.arrays import (
    check_bt,
    f32,
    f64,
    group_all_equal,
    group_ids,
    masked_mean,
)

# ---------------------------------------------------------------------------------------------------
# advantage estimators (spec 2.1, 2.2)


@dataclass(frozen=True)
class EstimatorParams:
    """Estimator settings from `trainer.algorithm`: `gamma`, `lambd`, `grpo_norm_by_std`; `epsilon` is
    GRPO's std epsilon and MaxRL's mean epsilon (a SkyRL function default, not a config field)."""

    gamma: float = 1.0
    lambd: float = 1.0
    grpo_norm_by_std: bool = True
    epsilon: float = 1e-6


AdvantageFn = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, EstimatorParams],
                       tuple[np.ndarray, np.ndarray]]
"""fn(token_rewards_bt, response_mask_bt, group_b, values_bt | None, params) -> (advantages_bt, returns_bt)"""

ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage_estimator", strict=True)


def register_advantage_estimator(name: str, fn: AdvantageFn | None = None, *, replace: bool = False):
    """Register an estimator under `name` (`@register_advantage_estimator("name")` or a plain call).
    It becomes selectable as `trainer.algorithm.advantage_estimator`. Re-registering a name raises unless
    `replace=True`."""

    def add(f: AdvantageFn) -> AdvantageFn:
        return ADVANTAGE_ESTIMATORS.register(name, f, replace=replace)

    return add(fn) if fn is not None else add


def advantage_estimator(name: str) -> AdvantageFn:
    return ADVANTAGE_ESTIMATORS.get(name)


def advantage_estimator_names() -> tuple[str, ...]:
    return tuple(ADVANTAGE_ESTIMATORS.names())


def compute_advantages(name: str, token_rewards_bt, response_mask_bt, group_b, values_bt=None,
                       params: EstimatorParams = EstimatorParams()) -> tuple[np.ndarray, np.ndarray]:
    """Run estimator `name` on float64 copies of the inputs; returns float32 (advantages_bt, returns_bt)."""
    r = check_bt("token_rewards_bt", f64(token_rewards_bt))
    m = check_bt("response_mask_bt", f64(response_mask_bt), r.shape)
    v = None if values_bt is None else check_bt("values_bt", f64(values_bt), r.shape)
    adv, ret = advantage_estimator(name)(r, m, np.asarray(group_b), v, params)
    return f32(adv), f32(ret)


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
    scores_b = f64(token_rewards_bt).sum(axis=1)
    gid_b, n_groups = group_ids(group_b, scores_b.shape[0])
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
    adv_bt = f32(adv_b[:, None] * f64(response_mask_bt))
    return adv_bt, adv_bt.copy()


@register_advantage_estimator("rloo")
def rloo(token_rewards_bt, response_mask_bt, group_b, values_bt, params):
    """Leave-one-out baseline: adv = (score - mean_g) * n/(n-1) for a group of n > 1 (= score minus the
    mean of the others); a singleton group gets 0 (with a warning). A = adv_b * response_mask; returns = A."""
    scores_b = f64(token_rewards_bt).sum(axis=1)
    gid_b, n_groups = group_ids(group_b, scores_b.shape[0])
    count_g = np.bincount(gid_b, minlength=n_groups).astype(np.float64)
    mean_g = np.bincount(gid_b, weights=scores_b, minlength=n_groups) / np.maximum(count_g, 1.0)
    n_b = count_g[gid_b]
    if (n_b == 1).any():
        warnings.warn("rloo: a group with one sample has no leave-one-out baseline; its advantage is 0",
                      RuntimeWarning, stacklevel=2)
    adv_b = np.where(n_b > 1, (scores_b - mean_g[gid_b]) * n_b / np.maximum(n_b - 1.0, 1.0), 0.0)
    adv_bt = f32(adv_b[:, None] * f64(response_mask_bt))
    return adv_bt, adv_bt.copy()


@register_advantage_estimator("maxrl")
def maxrl(token_rewards_bt, response_mask_bt, group_b, values_bt, params):
    """MaxRL (mean-normalised group-relative reward): score_b = sum_t r; in a group of n > 1,
    adv = (score - mean_g) / (mean_g + epsilon); a singleton group uses mean 0 and no division (adv = score),
    as SkyRL 0.4.0. A = adv_b * response_mask; returns = A."""
    scores_b = f64(token_rewards_bt).sum(axis=1)
    gid_b, n_groups = group_ids(group_b, scores_b.shape[0])
    count_g = np.bincount(gid_b, minlength=n_groups).astype(np.float64)
    mean_g = np.bincount(gid_b, weights=scores_b, minlength=n_groups) / np.maximum(count_g, 1.0)
    single_b = count_g[gid_b] == 1
    mean_b = np.where(single_b, 0.0, mean_g[gid_b])
    adv_b = np.where(single_b, scores_b, (scores_b - mean_b) / np.where(single_b, 1.0, mean_b + params.epsilon))
    adv_bt = f32(adv_b[:, None] * f64(response_mask_bt))
    return adv_bt, adv_bt.copy()


@register_advantage_estimator("reinforce++")
def reinforce_pp(token_rewards_bt, response_mask_bt, group_b, values_bt, params):
    """Discounted return-to-go G (reset outside the response mask), whitened over the whole batch:
    A = masked_whiten(G, R) * R; returns = G. Uses `gamma`."""
    r = f64(token_rewards_bt)
    m = f64(response_mask_bt)
    returns_bt = np.zeros_like(r)
    running_b = np.zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        running_b = r[:, t] + params.gamma * running_b
        returns_bt[:, t] = running_b
        running_b = running_b * m[:, t]
    return f32(_masked_whiten(returns_bt, m) * m), f32(returns_bt)


@register_advantage_estimator("gae")
def gae(token_rewards_bt, response_mask_bt, group_b, values_bt, params):
    """Generalised advantage estimation with the critic's values V (`gamma`, `lambd`):
    delta_t = r_t + gamma V_{t+1} - V_t (V_T = 0), A_t = delta_t + gamma lambd A_{t+1};
    returns = A + V; advantages = masked_whiten(A, R). As in SkyRL the recursion runs over padded
    positions unmasked and the whitened advantages are not re-masked, so pass V = 0 on padding."""
    if values_bt is None:
        raise ValueError("advantage_estimator 'gae' needs critic values (values_bt is None)")
    r = f64(token_rewards_bt)
    v = f64(values_bt)
    adv_bt = np.zeros_like(r)
    last_b = np.zeros(r.shape[0])
    n_t = r.shape[1]
    for t in range(n_t - 1, -1, -1):
        next_b = v[:, t + 1] if t < n_t - 1 else 0.0
        last_b = r[:, t] + params.gamma * next_b - v[:, t] + params.gamma * params.lambd * last_b
        adv_bt[:, t] = last_b
    returns_bt = adv_bt + v
    return f32(_masked_whiten(adv_bt, f64(response_mask_bt))), f32(returns_bt)


def batch_normalize_advantages(advantages_bt, mask_bt) -> np.ndarray:
    """`advantage_batch_normalize` (masked variant, spec 2.2): mu, var = masked mean / variance over the
    whole batch; A = where(M > 0, A - mu, 0) / sqrt(max(var, 1e-8))."""
    a = check_bt("advantages_bt", f64(advantages_bt))
    m = check_bt("mask_bt", f64(mask_bt), a.shape)
    mu = masked_mean(a, m)
    var = masked_mean((a - mu) ** 2, m)
    return f32(np.where(m > 0, a - mu, 0.0) / np.sqrt(max(var, 1e-8)))



# ---------------------------------------------------------------------------------------------------
# rollout filters (spec 2.6) and KL in reward (spec 2.4)


def zero_variance_mask(scores_b, group_b) -> np.ndarray:
    """`zero_variance_filter`: False for every row of a group (size > 1) whose scores are all equal
    (population std 0); singletons are kept. tx applies it to score_b = sum_t r, token-level rewards too."""
    s = f64(scores_b).reshape(-1)
    gid_b, n_groups = group_ids(group_b, s.shape[0])
    equal_g, count_g = group_all_equal(s, gid_b, n_groups)
    return ~(equal_g & (count_g > 1))[gid_b]


def dynamic_sampling_filter(scores_b, group_b, n_samples: int) -> np.ndarray:
    """`dynamic_sampling`: True for the rows of "good" groups, those whose scores are not all equal
    (std > 0), or every row when n_samples_per_prompt == 1."""
    s = f64(scores_b).reshape(-1)
    if n_samples == 1:
        return np.ones(s.shape[0], bool)
    gid_b, n_groups = group_ids(group_b, s.shape[0])
    equal_g, _ = group_all_equal(s, gid_b, n_groups)
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
    r = check_bt("token_rewards_bt", f64(token_rewards_bt))
    m = check_bt("mask_bt", f64(mask_bt), r.shape)
    kl = check_bt("kl_bt", f64(kl_bt), r.shape) * m
    current = float(masked_mean(kl, m, axis=1).mean()) if r.shape[0] else 0.0
    return f32(r - max(0.0, float(coef)) * kl), current
