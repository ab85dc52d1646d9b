"""One RL experiment of a job (`Run`): its adapter's model id, its effective config and its algorithm state (loss
parameters, KL controller, off-policy correction). A job trains one or several runs in shared device batches."""

from __future__ import annotations

from dataclasses import dataclass

from tx.rl import algorithms, critic
from tx.rl.config import RLConfig


@dataclass
class Run:
    """One RL experiment of the job: its adapter (model id = name), its effective config and algorithm state."""

    name: str
    cfg: RLConfig
    loss_params: dict[str, float]
    kl_ctrl: algorithms.KLController
    correction: algorithms.OffPolicyCorrection

    @property
    def critic(self) -> str | None:
        """The model id of its critic (`gae` runs), else None."""
        return critic.critic_id(self.name) if self.cfg.trainer.algorithm.advantage_estimator == "gae" else None

    @classmethod
    def build(cls, name: str, cfg: RLConfig) -> Run:
        a = cfg.trainer.algorithm
        return cls(name, cfg, a.policy_loss_params(),
                   algorithms.KLController(a.kl_ctrl.type, a.kl_loss_coef, a.kl_ctrl.kl_target, a.kl_ctrl.horizon),
                   a.correction())


def recomputes_old(run: Run, full: bool) -> bool:
    """Whether `run`'s old log-probs come from a forward of its weights rather than from the sampler: at a
    training temperature (the sampler's are untempered), in full training (bf16 weights: the decode loop and the
    training pass round differently), and whenever the off-policy correction is on (its ratio old / rollout
    is what it corrects; with old = rollout it would be 1 and never act)."""
    return run.cfg.trainer.algorithm.temperature != 1.0 or full or run.correction.enabled
