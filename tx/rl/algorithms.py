"""RL algorithms of SkyRLTrainConfig's `trainer.algorithm`: advantage estimators, KL estimators, policy
losses, loss reduction, off-policy correction, rollout filters and the in-reward KL controller.

Host side (numpy, float64 inside, float32 out): everything computed once per training batch or per
optimizer mini-batch from whole-batch arrays (`*_bt` = [sequences, response positions], `*_b` = per
sequence). Device side (JAX): the KL estimators and the policy losses, which see one datum (sequence) at a
time so they vmap like `tx.losses` losses.

How a trainer puts them together for one optimizer mini-batch (spec 2.3-2.5, 2.7):

    tis_bt, mask_bt, m = apply_off_policy_correction(cfg, old_bt, roll_bt, loss_mask_bt)
    adv_bt, w_bt = place_reduction(placement, loss_reduction, adv_bt, mask_bt, max_seq_len, group_b, micro_bs)
    w_bt = w_bt * tis_bt
    loss = sum_b sum_t spec.fn(lp_t, {"old_logprobs", "rollout_logprobs", "advantages", "mask": loss_mask_t,
                                      "selected"}, params) * w_bt
           + kl_loss_coef * sum(kl_estimate(kind, lp, ref) * sequence_mean_weights(mask_bt))

placement "loss" (tx): the reduction is the per-token weight; "advantages" (SkyRL 0.4.0): it scales the
advantages and the policy term is a plain masked sum (see `reduction_in_advantages`). `mask` given to a loss is
the loss mask *before* off-policy correction (gspo's sequence ratio reads it, as SkyRL does); the correction acts
through the weights. `rollout_logprobs` are the sampler's log-probs (= old_logprobs when the trainer does not
recompute them). Registries (advantage estimators, policy losses) are per process: register custom ones in a
module every host imports.
"""

from tx.rl.advantages import (ADVANTAGE_ESTIMATORS, AdvantageFn, EstimatorParams, KLController,  # noqa: F401
                              advantage_estimator, advantage_estimator_names, apply_kl_in_reward,
                              batch_normalize_advantages, compute_advantages, dynamic_sampling_filter,
                              register_advantage_estimator, zero_variance_mask)
from tx.rl.policy_losses import (KL_ESTIMATORS, POLICY_LOSSES, POLICY_LOSS_INPUT_KEYS,  # noqa: F401
                                 POLICY_LOSS_PARAM_CHOICES, POLICY_LOSS_PARAM_FIELDS,
                                 POLICY_LOSSES_WITHOUT_OLD_LOGPROBS, PolicyLossFn, PolicyLossSpec,
                                 check_policy_loss_config, cispo_metrics, clip_fraction, kl_estimate,
                                 on_policy_loss_registered, policy_loss, policy_loss_names, policy_loss_param_value,
                                 register_policy_loss, rollout_logprobs, select_cov_tokens,
                                 unregister_policy_loss, value_clip_fraction, value_loss)
from tx.rl.reductions import (LOSS_REDUCTIONS, REDUCTION_PLACEMENTS, OffPolicyCorrection,  # noqa: F401
                              apply_off_policy_correction, place_reduction, reduction_in_advantages,
                              reduction_scale, reduction_weights, sequence_mean_weights)

__all__ = [
    "EstimatorParams", "AdvantageFn", "register_advantage_estimator", "advantage_estimator",
    "advantage_estimator_names", "compute_advantages", "batch_normalize_advantages",
    "KL_ESTIMATORS", "kl_estimate",
    "PolicyLossFn", "PolicyLossSpec", "POLICY_LOSS_INPUT_KEYS", "POLICY_LOSS_PARAM_FIELDS",
    "POLICY_LOSS_PARAM_CHOICES", "POLICY_LOSSES_WITHOUT_OLD_LOGPROBS", "policy_loss_param_value",
    "rollout_logprobs", "check_policy_loss_config",
    "register_policy_loss", "unregister_policy_loss", "policy_loss", "policy_loss_names", "select_cov_tokens", "clip_fraction",
    "cispo_metrics", "value_loss", "value_clip_fraction",
    "LOSS_REDUCTIONS", "REDUCTION_PLACEMENTS", "reduction_scale", "reduction_weights", "reduction_in_advantages",
    "place_reduction", "sequence_mean_weights",
    "OffPolicyCorrection", "apply_off_policy_correction",
    "zero_variance_mask", "dynamic_sampling_filter", "KLController", "apply_kl_in_reward",
]
