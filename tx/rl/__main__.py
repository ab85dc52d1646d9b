"""`python -m tx.rl --config rl.yaml [key=value ...]`: RL training with the seed's SkyRLTrainConfig names.

The config keeps SkyRL's names and nesting: `data.{train_data,val_data}`, `trainer.policy.model.{path,lora}`,
`trainer.policy.optimizer_config.*`, `trainer.algorithm.*` (advantage_estimator, policy_loss_type,
loss_reduction, use_kl_loss, kl_estimator_type, off_policy_correction, ...), `trainer.{epochs,
train_batch_size, policy_mini_batch_size, update_epochs_per_batch, eval_interval, ckpt_path, ...}`,
`generator.{n_samples_per_prompt, max_turns, sampling_params, ...}`, `environment.env_class`.
`environment.imports` lists modules that register user envs, policy losses or advantage estimators;
`runs: [{name, trainer: {...}}]` trains several runs (seeds, learning rates, ranks, algorithms) on one base
model in shared batches; `tx:` holds tx-only settings (metrics_file, max_num_seqs, micro_batch_tokens, ...).
`--base-url http://HOST:PORT` trains on a running `python -m tx.run --import tx.rl` server through the tinker SDK
(key from TINKER_API_KEY) instead of in this process: the same trainer, the same numbers.
Fields that only steer Ray, vLLM, Megatron or PyTorch FSDP are refused with the reason.

Overrides use dotted keys, values parsed as YAML: `trainer.train_batch_size=8`,
`trainer.algorithm.policy_loss_type=gspo`, `generator.sampling_params.max_generate_length=64`.
Data rows (JSONL / Parquet) carry `prompt` (chat messages), optionally `env_class`, and any other columns
(e.g. `reward_spec`), handed to the env's `init` as `extras`. Metrics print as one JSON line per step.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from pydantic import ValidationError

from tx.training.overrides import load_values
from tx.training.progress import add_progress_flag

if TYPE_CHECKING:
    from tx.rl.config import RLConfig


def load_config(path: str | None, overrides: list[str]) -> RLConfig:
    from tx.rl.config import RLConfig

    values, _ = load_values(path, overrides)
    imports = (values.get("environment") or {}).get("imports") or []
    if imports:  # user policy losses / estimators must be registered before the config names them
        from tx.rl.env import import_env_modules

        import_env_modules(imports)
    return RLConfig.model_validate(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tx.rl", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file of SkyRLTrainConfig fields")
    parser.add_argument("--base-url", help="a tx.run server to train on (same as tx.base_url=URL)")
    add_progress_flag(parser)
    parser.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys)")
    args = parser.parse_args(argv)
    if args.base_url:
        args.overrides.append(f"tx.base_url={args.base_url}")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ValidationError, ValueError, ImportError) as e:
        print(f"invalid RL config:\n{e}", file=sys.stderr)
        return 2
    from tx.rl.trainer import RLTrainer

    try:
        trainer = RLTrainer(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"invalid RL setup: {e}", file=sys.stderr)
        return 2
    trainer.metrics.stdout = True  # metrics to stdout as JSON lines too
    trainer.progress = args.progress
    trainer.fit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
