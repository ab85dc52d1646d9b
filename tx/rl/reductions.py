"""Loss reduction over a mini-batch (token_mean, sequence_mean, seq_mean_token_sum_norm, prompt_mean,
token_mean_legacy) as per-token weights on the loss or folded into the advantages, and the off-policy correction
(token / sequence TIS caps and masks), host side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from tx.rl.arrays import check_bt, f32, f64, group_ids, safe_exp

# ---------------------------------------------------------------------------------------------------
# loss reduction (spec 2.5) as per-token weights, or (SkyRL >= 0.4) folded into the advantages

LOSS_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean", "token_mean_legacy")
REDUCTION_PLACEMENTS = ("loss", "advantages")


def reduction_scale(kind: str, mask_bt, max_seq_len: int | None = None, group_b=None,
                    micro_batch_size: int | None = None) -> np.ndarray:
    """Per-token factor s (float64 [b, t], not masked) with sum(L * M * s) = the `loss_reduction` of L over the
    given batch (the optimizer mini-batch of Bm rows; pass every row of it, fully masked ones included):
    token_mean: 1 / max(sum M, 1); sequence_mean: 1 / (Bm * max(sum_t M, 1));
    seq_mean_token_sum_norm (Dr. GRPO): 1 / (Bm * max_seq_len);
    prompt_mean: 1 / (P * max(sum of M over the rows of the prompt, 1)), P = number of distinct `group_b` ids
    (prompts) in the batch, a prompt with no valid token counting too: the mean over prompts of each prompt's
    token mean; token_mean_legacy: rows cut into consecutive micro-batches of `micro_batch_size` (the last may be
    shorter), 1 / (n_micro * max(sum of M over the micro-batch, 1)): the mean over micro-batches of their token
    means. (SkyRL 0.4.0 takes n_micro = Bm // micro_batch_size and gives the rows past n_micro * micro_batch_size
    factor 0; tx counts the shorter last micro-batch as one more.)"""
    m = check_bt("mask_bt", f64(mask_bt))
    n_rows = max(m.shape[0], 1)
    if kind == "token_mean":
        return np.full(m.shape, 1.0 / max(m.sum(), 1.0))
    if kind == "sequence_mean":
        return np.broadcast_to(1.0 / (n_rows * np.maximum(m.sum(axis=1, keepdims=True), 1.0)), m.shape).copy()
    if kind == "seq_mean_token_sum_norm":
        if max_seq_len is None or max_seq_len <= 0:
            raise ValueError(f"loss_reduction 'seq_mean_token_sum_norm' needs a positive max_seq_len, got {max_seq_len!r}")
        return np.full(m.shape, 1.0 / (n_rows * float(max_seq_len)))
    if kind == "prompt_mean":
        if group_b is None:
            raise ValueError("loss_reduction 'prompt_mean' needs the prompt (group) id of every row: group_b is None")
        gid_b, n_groups = group_ids(group_b, m.shape[0])
        tokens_g = np.bincount(gid_b, weights=m.sum(axis=1), minlength=n_groups)
        return np.broadcast_to((1.0 / (max(n_groups, 1) * np.maximum(tokens_g, 1.0)))[gid_b][:, None], m.shape).copy()
    if kind == "token_mean_legacy":
        if micro_batch_size is None or micro_batch_size <= 0:
            raise ValueError(f"loss_reduction 'token_mean_legacy' needs a positive micro_batch_size "
                             f"(trainer.micro_train_batch_size_per_gpu), got {micro_batch_size!r}")
        chunk_b = np.arange(m.shape[0]) // micro_batch_size
        n_micro = max(-(-m.shape[0] // micro_batch_size), 1)
        tokens_c = np.bincount(chunk_b, weights=m.sum(axis=1), minlength=n_micro)
        return np.broadcast_to((1.0 / (n_micro * np.maximum(tokens_c, 1.0)))[chunk_b][:, None], m.shape).copy()
    raise ValueError(f"unknown loss_reduction {kind!r}; expected one of {', '.join(LOSS_REDUCTIONS)}")


def reduction_weights(kind: str, mask_bt, max_seq_len: int | None = None, group_b=None,
                      micro_batch_size: int | None = None) -> np.ndarray:
    """Per-token weights w = M * `reduction_scale(...)` (float32), so sum(L * w) = the `loss_reduction` of L:
    the reduction placed on the loss (tx's placement "loss")."""
    m = check_bt("mask_bt", f64(mask_bt))
    return f32(m * reduction_scale(kind, m, max_seq_len, group_b, micro_batch_size))


def reduction_in_advantages(kind: str, advantages_bt, mask_bt, max_seq_len: int | None = None, group_b=None,
                            micro_batch_size: int | None = None) -> np.ndarray:
    """SkyRL 0.4.0's placement "advantages" (apply_loss_reduction_to_advantages_minibatch): A' = A * s with
    s = `reduction_scale(...)`, over one optimizer mini-batch; the policy loss is then the plain masked sum
    sum(L(A') * M) (per-token weights M, times the TIS factor). Equal to placement "loss" for a loss positively
    homogeneous in A (L(sA) = s L(A), s > 0), which every built-in loss but clip_cov and kl_cov is."""
    a = check_bt("advantages_bt", f64(advantages_bt))
    m = check_bt("mask_bt", f64(mask_bt), a.shape)
    return f32(a * reduction_scale(kind, m, max_seq_len, group_b, micro_batch_size))


def place_reduction(placement: str, kind: str, advantages_bt, mask_bt, max_seq_len: int | None = None,
                    group_b=None, micro_batch_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(advantages_bt, weights_bt), float32, for the policy-loss term sum(L(advantages) * weights):
    "loss" (tx): (A, M * s); "advantages" (SkyRL 0.4.0): (A * s, M)."""
    a = check_bt("advantages_bt", f64(advantages_bt))
    m = check_bt("mask_bt", f64(mask_bt), a.shape)
    if placement == "loss":
        return f32(a), reduction_weights(kind, m, max_seq_len, group_b, micro_batch_size)
    if placement == "advantages":
        return reduction_in_advantages(kind, a, m, max_seq_len, group_b, micro_batch_size), f32(m)
    raise ValueError(f"unknown loss-reduction placement {placement!r}; expected one of {', '.join(REDUCTION_PLACEMENTS)}")


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
    of the input mask; row fractions for the row masks; fractions of valid tokens for token-level ones (the token
    mask's as SkyRL 0.4.0's `token_mask_ratio` and, same value, tx's `token_mask_masked_ratio`)."""
    m = check_bt("mask_bt", f64(mask_bt))
    if not cfg.enabled:
        return np.ones(m.shape, np.float32), f32(m), {}
    old = check_bt("old_logprobs_bt", f64(old_logprobs_bt), m.shape)
    roll = check_bt("rollout_logprobs_bt", f64(rollout_logprobs_bt), m.shape)
    d = old - roll
    rho = safe_exp(d)
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
        metrics.update(token_mask_ratio=(under | over).sum() / n_valid,  # SkyRL 0.4.0's name
                       token_mask_masked_ratio=(under | over).sum() / n_valid,
                       token_mask_under_low_ratio=under.sum() / n_valid, token_mask_over_high_ratio=over.sum() / n_valid)

    seq_log_b = (d * m).sum(axis=1)
    tis = np.ones(m.shape)
    if cfg.tis_ratio_type == "token":
        cap = cfg.token_tis_ratio_clip_high
        tis = np.minimum(rho, cap)
        metrics["tis_token_clip_high_ratio"] = ((rho > cap) & (m > 0)).sum() / max((m > 0).sum(), 1)
    elif cfg.tis_ratio_type == "sequence":
        cap = cfg.sequence_tis_ratio_clip_high
        seq_b = safe_exp(seq_log_b)
        tis = np.broadcast_to(np.minimum(seq_b, cap)[:, None], m.shape)
        metrics["tis_seq_clip_high_ratio"] = (seq_b > cap).sum() / n_rows

    if cfg.sequence_mask_metric is not None:
        if cfg.sequence_mask_metric == "geometric":
            prefix, lo, hi = "geo", cfg.geo_mask_low, cfg.geo_mask_high
            value_b = safe_exp(seq_log_b / np.maximum(m.sum(axis=1), 1.0))
        else:
            prefix, lo, hi = "product", cfg.product_mask_low, cfg.product_mask_high
            value_b = safe_exp(seq_log_b)
        over_b, under_b = value_b > hi, value_b < lo
        m = m * ~(over_b | under_b)[:, None]
        metrics.update({f"{prefix}_sequence_mask_masked_ratio": (over_b | under_b).sum() / n_rows,
                        f"{prefix}_sequence_mask_over_high_ratio": over_b.sum() / n_rows,
                        f"{prefix}_sequence_mask_under_low_ratio": under_b.sum() / n_rows})
    return f32(tis), f32(m), {k: float(v) for k, v in metrics.items()}
