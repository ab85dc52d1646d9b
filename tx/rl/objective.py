"""The device objective of every tx.rl run: one registered tx loss, "tx.rl", for every policy loss and KL estimator.

Per token: `weights * policy_loss + kl_loss_coef * kl_weights * kl(logprobs, ref_logprobs)
- entropy_loss_coef * entropy_weights * entropy`, where `weights` carry the `loss_reduction` over the mini-batch
and the TIS factors (with `algorithm.loss_reduction_placement: advantages` the reduction is in the advantages and
`weights` are the corrected mask times TIS), `kl_weights` the KL term's sequence mean (SkyRL's) and `entropy_weights` the entropy's
masked token mean; the policy loss reads the old log-probs (`logprobs`) and the sampler's (`rl_rollout_logprobs`:
rollout_is, dppo and cispo anchored at the rollout read them). The policy loss and the KL estimator are chosen per datum by `loss_fn_config` numbers
(`policy_loss` = `policy_loss_id(name)`, `kl_estimator` = its index in `KL_ORDER`), so one registered loss serves
every run of a job, in-process and on a server started with `python -m tx.run --import tx.rl` (plus the modules
that register your own policy losses: the server must hold the same ones). A number that names no registered
policy loss fails that request alone, naming it.

The critic of `gae` runs trains with "tx.rl.value": `weights * value_loss(V, old_values, returns, value_clip)`,
V from its adapter's value head (`needs_values`), `weights` SkyRL's per-sequence masked mean then batch mean.

One loss instead of one per (policy loss, KL estimator): the backend evaluates every registered loss on every
row, so the pairs would multiply that cost and the number of compiled programs.
"""

from __future__ import annotations

import zlib
from typing import Mapping

import jax.numpy as jnp

from tx import losses
from tx.rl import algorithms

OBJECTIVE = "tx.rl"
VALUE_OBJECTIVE = "tx.rl.value"
VALUE_INPUTS = ("returns", "old_values")
EXTRA_INPUTS = ("ref_logprobs", "kl_weights", "entropy_weights", "rl_mask", "rl_selected", "rl_rollout_logprobs")
KL_ORDER = tuple(sorted(algorithms.KL_ESTIMATORS))
_SELECTORS = ("policy_loss", "kl_estimator", "kl_loss_coef", "entropy_loss_coef")


def policy_loss_id(name: str) -> float:
    """A policy loss's number in `loss_fn_config["policy_loss"]`: from its name, so a client and a server that
    registered the same losses in any order agree; < 2**24, exact in float32."""
    return float(zlib.crc32(name.encode()) & 0xFFFFFF)


def objective_config(policy_loss_type: str, kl_estimator: str, params: Mapping[str, float], kl_loss_coef: float,
                     entropy_loss_coef: float) -> dict[str, float]:
    """The `loss_fn_config` of a datum of the objective."""
    if kl_estimator not in KL_ORDER:
        raise KeyError(f"unknown kl_estimator_type {kl_estimator!r}; known: {', '.join(KL_ORDER)}")
    return {"policy_loss": policy_loss_id(policy_loss_type), "kl_estimator": float(KL_ORDER.index(kl_estimator)),
            "kl_loss_coef": float(kl_loss_coef), "entropy_loss_coef": float(entropy_loss_coef),
            **{k: float(v) for k, v in algorithms.policy_loss(policy_loss_type).resolve(params).items()}}


def _check(config: Mapping[str, float]) -> None:
    ids = {policy_loss_id(n): n for n in algorithms.policy_loss_names()}
    if float(config["policy_loss"]) not in ids:
        raise ValueError(f"loss_fn_config['policy_loss']={config['policy_loss']} names no policy loss registered here "
                         f"(registered: {', '.join(f'{n}={i:.0f}' for i, n in sorted(ids.items(), key=lambda x: x[1]))}); "
                         f"a server needs `--import` of the module that registers yours")
    k = config["kl_estimator"]
    if k not in range(len(KL_ORDER)):
        raise ValueError(f"loss_fn_config['kl_estimator']={k} is not an index of {list(KL_ORDER)}")


def _objective(tlp, inputs, config):
    mask, weights, kl_weights = inputs["rl_mask"], inputs["weights"], inputs["kl_weights"]
    # Positions outside a term (weight 0) are masked before the multiply, as SkyRL does: a non-finite input there
    # (a reference log-prob of a padded or masked token, say) must not become 0 * NaN = NaN in the loss or its
    # gradient. The policy losses also read the loss mask (gspo's sequence ratio), so inputs stay where it is on.
    policy_on = (weights != 0) | (mask > 0)
    per_token = jnp.zeros_like(tlp)
    for name in algorithms.policy_loss_names():
        spec = algorithms.policy_loss(name)
        on = config["policy_loss"] == policy_loss_id(name)
        # a loss this datum does not use sees zeros (finite everywhere), so it cannot put inf / NaN in the gradient
        keep = lambda x, on=on: jnp.where(on & policy_on, x, 0.0)  # noqa: E731
        value = spec.fn(keep(tlp), {"old_logprobs": keep(inputs["logprobs"]),
                                    "rollout_logprobs": keep(inputs["rl_rollout_logprobs"]),
                                    "advantages": keep(inputs["advantages"]), "mask": keep(mask),
                                    "selected": keep(inputs["rl_selected"])},
                        {k: config[k] for k in spec.params})
        per_token = jnp.where(on, value, per_token)
    kl = jnp.zeros_like(tlp)
    kl_on = kl_weights != 0
    for i, kind in enumerate(KL_ORDER):
        on = (config["kl_estimator"] == i) & kl_on
        value = algorithms.kl_estimate(kind, jnp.where(on, tlp, 0.0), jnp.where(on, inputs["ref_logprobs"], 0.0))
        kl = jnp.where(on, value, kl)
    return (jnp.where(weights != 0, weights * per_token, 0.0)
            + config["kl_loss_coef"] * jnp.where(kl_on, kl_weights * kl, 0.0)
            - config["entropy_loss_coef"] * inputs["entropy_weights"] * inputs["entropy"])


def register_objective(*_changed: object) -> None:
    """(Re-)register "tx.rl" over the policy losses registered now (runs again on each `register_policy_loss`)."""
    defaults = {"policy_loss": policy_loss_id("regular"), "kl_estimator": float(KL_ORDER.index("k3")),
                "kl_loss_coef": 0.0, "entropy_loss_coef": 0.0}
    for name in algorithms.policy_loss_names():
        for key, value in algorithms.policy_loss(name).params.items():
            if key in _SELECTORS:
                raise ValueError(f"policy loss {name!r}: parameter {key!r} clashes with the objective's own config key")
            defaults.setdefault(key, float(value))
    ids = [policy_loss_id(n) for n in algorithms.policy_loss_names()]
    if len(set(ids)) != len(ids):
        raise ValueError(f"two policy losses share a policy_loss id: {algorithms.policy_loss_names()}")
    losses.register(OBJECTIVE, _objective, config_defaults=defaults, input_keys=EXTRA_INPUTS, needs_entropy=True,
                    replace=True, check=_check)


def _value_objective(tlp, inputs, config):
    return inputs["weights"] * algorithms.value_loss(inputs["values"], inputs["old_values"], inputs["returns"],
                                                     config["value_clip"])


register_objective()
algorithms.on_policy_loss_registered(register_objective)
losses.register(VALUE_OBJECTIVE, _value_objective, config_defaults={"value_clip": 0.2}, input_keys=VALUE_INPUTS,
                needs_values=True, needs_logprobs=False, replace=True)
