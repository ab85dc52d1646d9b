"""The device objectives of tx.rl: one registered tx loss per policy loss, and the critic's value loss.

The objective of policy loss `p` is the tx loss `objective_name(p)` ("tx.rl.policy.<p>"); per token:
`weights * policy_loss + kl_loss_coef * kl_weights * kl(logprobs, ref_logprobs)
- entropy_loss_coef * entropy_weights * entropy`, where `weights` carry the `loss_reduction` over the mini-batch
and the TIS factors (with `algorithm.loss_reduction_placement: advantages` the reduction is in the advantages and
`weights` are the corrected mask times TIS), `kl_weights` the KL term's sequence mean (SkyRL's) and
`entropy_weights` the entropy's masked token mean; the policy loss reads the old log-probs (`logprobs`) and the
sampler's (`rl_rollout_logprobs`: rollout_is, dppo and cispo anchored at the rollout read them). The KL estimator
is chosen per datum by `loss_fn_config["kl_estimator"]`, its index in the built-in `KL_ORDER`.

Registering a policy loss (`register_policy_loss`) registers its objective, in-process and on a server started
with `python -m tx.run --import tx.rl` (plus the modules that register your own policy losses: the server must
hold the same ones; a datum naming an objective the server lacks fails alone, naming it). A training pass
evaluates only the losses its rows use, so one loss per policy loss costs nothing where it is not used.

The critic of `gae` runs trains with "tx.rl.value": `weights * value_loss(V, old_values, returns, value_clip)`,
V from its adapter's value head (`needs_values`), `weights` SkyRL's per-sequence masked mean then batch mean.
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax.numpy as jnp

from tx import losses
from tx.rl import algorithms

POLICY_PREFIX = "tx.rl.policy."
VALUE_OBJECTIVE = "tx.rl.value"
VALUE_INPUTS = ("returns", "old_values")
EXTRA_INPUTS = ("ref_logprobs", "kl_weights", "entropy_weights", "rl_mask", "rl_selected", "rl_rollout_logprobs")
KL_ORDER = tuple(sorted(algorithms.KL_ESTIMATORS))
_SELECTORS = ("kl_estimator", "kl_loss_coef", "entropy_loss_coef")


def objective_name(policy_loss_type: str) -> str:
    """The registered tx loss that trains with policy loss `policy_loss_type`."""
    return POLICY_PREFIX + policy_loss_type


def objective_config(policy_loss_type: str, kl_estimator: str, params: Mapping[str, float], kl_loss_coef: float,
                     entropy_loss_coef: float) -> dict[str, float]:
    """The `loss_fn_config` of a datum of `objective_name(policy_loss_type)`."""
    if kl_estimator not in KL_ORDER:
        raise KeyError(f"unknown kl_estimator_type {kl_estimator!r}; known: {', '.join(KL_ORDER)}")
    return {"kl_estimator": float(KL_ORDER.index(kl_estimator)), "kl_loss_coef": float(kl_loss_coef),
            "entropy_loss_coef": float(entropy_loss_coef),
            **{k: float(v) for k, v in algorithms.policy_loss(policy_loss_type).resolve(params).items()}}


def _check(config: Mapping[str, float]) -> None:
    k = config["kl_estimator"]
    if k not in range(len(KL_ORDER)):
        raise ValueError(f"loss_fn_config['kl_estimator']={k} is not an index of {list(KL_ORDER)}")


def _objective(spec: algorithms.PolicyLossSpec) -> Callable:
    def objective(tlp, inputs, config):
        mask, weights, kl_weights = inputs["rl_mask"], inputs["weights"], inputs["kl_weights"]
        # Positions outside a term (weight 0) are masked before the multiply, as SkyRL does: a non-finite input
        # there (a reference log-prob of a padded or masked token, say) must not become 0 * NaN = NaN in the loss
        # or its gradient. The policy losses also read the loss mask (gspo's sequence ratio), so inputs stay
        # where it is on.
        policy_on = (weights != 0) | (mask > 0)
        keep = lambda x: jnp.where(policy_on, x, 0.0)  # noqa: E731
        per_token = spec.fn(keep(tlp), {"old_logprobs": keep(inputs["logprobs"]),
                                        "rollout_logprobs": keep(inputs["rl_rollout_logprobs"]),
                                        "advantages": keep(inputs["advantages"]), "mask": keep(mask),
                                        "selected": keep(inputs["rl_selected"])},
                            {k: config[k] for k in spec.params})
        kl = jnp.zeros_like(tlp)
        kl_on = kl_weights != 0
        for i, kind in enumerate(KL_ORDER):  # a handful of elementwise terms: the datum's own is selected
            on = (config["kl_estimator"] == i) & kl_on
            value = algorithms.kl_estimate(kind, jnp.where(on, tlp, 0.0), jnp.where(on, inputs["ref_logprobs"], 0.0))
            kl = jnp.where(on, value, kl)
        return (jnp.where(weights != 0, weights * per_token, 0.0)
                + config["kl_loss_coef"] * jnp.where(kl_on, kl_weights * kl, 0.0)
                - config["entropy_loss_coef"] * inputs["entropy_weights"] * inputs["entropy"])

    return objective


def sync_objective(name: str, spec: algorithms.PolicyLossSpec | None) -> None:
    """(Re-)register the objective of policy loss `name`, or remove it (`spec` None): runs on every change of
    the policy-loss registry."""
    if spec is None:
        losses.unregister(objective_name(name))
        return
    clash = sorted(set(spec.params) & set(_SELECTORS))
    if clash:
        raise ValueError(f"policy loss {name!r}: parameter {clash[0]!r} clashes with the objective's own config key")
    defaults = {"kl_estimator": float(KL_ORDER.index("k3")), "kl_loss_coef": 0.0, "entropy_loss_coef": 0.0,
                **{k: float(v) for k, v in spec.params.items()}}
    losses.register(objective_name(name), _objective(spec), config_defaults=defaults, input_keys=EXTRA_INPUTS,
                    needs_entropy=True, replace=True, check=_check)


def _value_objective(tlp, inputs, config):
    return inputs["weights"] * algorithms.value_loss(inputs["values"], inputs["old_values"], inputs["returns"],
                                                     config["value_clip"])


for _name in algorithms.policy_loss_names():
    sync_objective(_name, algorithms.policy_loss(_name))
algorithms.on_policy_loss_registered(sync_objective)
losses.register(VALUE_OBJECTIVE, _value_objective, config_defaults={"value_clip": 0.2}, input_keys=VALUE_INPUTS,
                needs_values=True, needs_logprobs=False, replace=True)
