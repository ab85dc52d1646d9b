"""tx.rl: the seed's RL trainer (SkyRLTrainConfig names) on the tx backend.

    import tx.rl

    @tx.rl.register_env("my_env")
    class MyEnv(tx.rl.Env):
        def init(self, prompt, extras): return prompt
        def step(self, action): return tx.rl.StepOutput(reward=float("42" in action), done=True)

Policy losses and advantage estimators register the same way (`tx.rl.register_policy_loss`,
`tx.rl.register_advantage_estimator`); list the module in the config's `environment.imports`. A server the
trainer drives through `--base-url` runs `python -m tx.run --import tx.rl` (and `--import` your module), so it
holds the RL objective and the same policy losses.
"""

from tx.rl.algorithms import register_advantage_estimator, register_policy_loss
from tx.rl.env import Env, StepOutput, make_env, register_env
from tx.rl import objective  # noqa: F401  registers a tx loss per policy loss

__all__ = ["Env", "StepOutput", "register_env", "make_env", "register_policy_loss", "register_advantage_estimator",
           "RLConfig", "RLTrainer"]


def __getattr__(name: str):
    # the trainer pulls in the backend; load it on first use
    if name == "RLTrainer":
        from tx.rl.trainer import RLTrainer

        return RLTrainer
    if name == "RLConfig":
        from tx.rl.config import RLConfig

        return RLConfig
    raise AttributeError(f"module 'tx.rl' has no attribute {name!r}")
