"""Time per RL step (tx.rl GRPO, or PPO with GAE and a critic), split into sampling / reference forward /
training, on a tiny and a ~100M model.

    python benchmarks/bench_rl.py                                       # both shapes, defaults sized for a 2-core CPU
    python benchmarks/bench_rl.py --shapes tiny --steps 8 --train-batch-size 16 --n-samples 4
    python benchmarks/bench_rl.py --advantage-estimator gae                 # + a critic adapter (value head)

Each shape runs an RLTrainer (config built from a dict with SkyRL's names): `--train-batch-size` prompts x
`--n-samples` samples per step, GRPO, the `regular` policy loss plus a KL loss against the base model
(`use_kl_loss: true`, so every step runs one reference forward), a LoRA adapter of `--rank`, the offline
`letters` env (charset digits) on synthetic prompts (one fixed user message, written to a temporary JSONL),
no eval, no checkpoints. `tiny` is the built-in tiny model (`trainer.policy.model.path: tiny`); `100m` is a
random Qwen3 checkpoint of the model-shape flags (defaults: ~100M parameters, vocab 32000).

`trainer.train_step()` runs `--steps` times. The first step compiles every program: it is reported alone as
`compile_step_s` and left out of the averages, which are over the remaining steps. Per step, the trainer's
record splits the time into `timing/generate` (sampling + env rewards), `timing/fwd_logprobs_values` (the
reference forward, and with `gae` the critic's values), `timing/critic_train` (gae: the critic's
forward_backward + optimizer step) and `timing/policy_train` (forward_backward + optimizer step per
mini-batch); `other_s` is the rest
of `timing/step` (reward shaping, advantages, building the batches). Generated tokens per step are the
record's `generate/avg_num_tokens` x prompts x samples. Prints one JSON line per shape.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from common import PeakRSS, add_model_args, random_model

PROMPT = "How many apples and trees are there? Answer with digits only."
MAX_PROMPT_LENGTH = 64  # the templated prompt above is well under this for the tiny tokenizer
DEFAULT_GENERATE = {"tiny": 64, "100m": 64}
DEFAULT_STEPS = {"tiny": 4, "100m": 4}
MODEL_FLAG_HELP = {
    "hidden_size": "hidden size of the 100m shape's random model (default: %(default)s)",
    "num_layers": "decoder layers of the 100m shape's random model (default: %(default)s)",
    "num_heads": "attention heads of the 100m shape's random model (default: %(default)s)",
    "num_kv_heads": "key/value heads of the 100m shape's random model (default: %(default)s)",
    "intermediate_size": "MLP intermediate size of the 100m shape's random model (default: %(default)s)",
    "vocab_size": "vocabulary size of the 100m shape's random model (>= the 512-token tiny tokenizer; default: %(default)s)",
}


def write_prompts(path: Path, rows: int) -> Path:
    """`rows` copies of one chat prompt for the `letters` env, charset digits."""
    row = {"prompt": [{"role": "user", "content": PROMPT}], "env_class": "letters", "charset": "digits"}
    path.write_text("".join(json.dumps(row) + "\n" for _ in range(rows)))
    return path


def rl_config(model_path: str, data: Path, args: argparse.Namespace, max_generate_length: int):
    from tx.rl.config import RLConfig

    return RLConfig.model_validate({
        "data": {"train_data": [str(data)], "val_data": [str(data)]},
        "trainer": {
            "policy": {"model": {"path": model_path, "lora": {"rank": args.rank, "alpha": 2 * args.rank}}},
            "algorithm": {"advantage_estimator": args.advantage_estimator, "policy_loss_type": "regular",
                          "use_kl_loss": True},
            **({"critic": {"model": {"lora": {"rank": args.rank, "alpha": 2 * args.rank}}},
                "critic_mini_batch_size": args.train_batch_size} if args.advantage_estimator == "gae" else {}),
            "epochs": 1,
            "train_batch_size": args.train_batch_size,
            "policy_mini_batch_size": args.train_batch_size,
            "micro_train_batch_size_per_gpu": args.micro_batch,
            "eval_before_train": False,
            "eval_interval": -1,
            "ckpt_interval": -1,
            "hf_save_interval": -1,
            "resume_mode": "none",
            "max_prompt_length": MAX_PROMPT_LENGTH,
            "logger": "console",
            "seed": 0,
        },
        "generator": {"n_samples_per_prompt": args.n_samples,
                      "sampling_params": {"max_generate_length": max_generate_length, "temperature": 1.0}},
        "environment": {"env_class": "letters"},
    })


def param_count(model_dir: Path) -> int:
    from tx.models.safetensors_io import SafetensorsDir

    files = SafetensorsDir(model_dir)
    return sum(int(np.prod(files.shape(k))) for k in files.keys())


def run_shape(shape: str, model_path: str, params: int | None, args: argparse.Namespace) -> dict:
    import jax

    from tx.rl.trainer import RLTrainer

    steps = args.steps or DEFAULT_STEPS[shape]
    if steps < 2:
        raise SystemExit("--steps must be at least 2: the first step compiles and is excluded from the averages")
    gen_len = args.max_generate_length or DEFAULT_GENERATE[shape]
    prompts, samples = args.train_batch_size, args.n_samples
    with tempfile.TemporaryDirectory() as tmp, PeakRSS() as rss:
        data = write_prompts(Path(tmp) / "prompts.jsonl", prompts * steps)
        built = time.perf_counter()
        trainer = RLTrainer(rl_config(model_path, data, args, gen_len))
        setup_s = time.perf_counter() - built
        records, compiles_after_first = [], None
        for _ in range(steps):
            records.append(trainer.train_step())
            if compiles_after_first is None:
                compiles_after_first = sum(trainer.policy.backend.metrics.compiles.values())
        compiles = dict(trainer.policy.backend.metrics.compiles)
        model_dir = Path(trainer.policy.backend.model_dir)
        model_cfg = trainer.policy.backend.model.config
        prompt_tokens = len(trainer.chat.prompt(trainer.train_rows[0].prompt))
        del trainer
    params = params if params is not None else param_count(model_dir)
    timed = records[1:]

    def mean(key: str) -> float:
        return float(np.mean([r[key] for r in timed]))

    step, sampling = mean("timing/step"), mean("timing/generate")
    reference, training = mean("timing/fwd_logprobs_values"), mean("timing/policy_train")
    critic = mean("timing/critic_train") if "timing/critic_train" in timed[0] else 0.0
    other = step - sampling - reference - training - critic
    generated = [r["generate/avg_num_tokens"] * prompts * samples for r in timed]
    sampled_tps = float(np.mean([g / r["timing/generate"] for g, r in zip(generated, timed)]))
    return {
        "workload": "rl_step", "framework": "tx", "advantage_estimator": args.advantage_estimator,
        "shapes": {"shape": shape, "params": params, "prompts": prompts, "samples": samples,
                   "max_generate_length": gen_len, "prompt_tokens": prompt_tokens, "rank": args.rank,
                   "hidden": model_cfg.hidden_size, "layers": model_cfg.num_hidden_layers,
                   "vocab": model_cfg.vocab_size, "steps_timed": len(timed)},
        "step_time_s": round(step, 4), "sampling_s": round(sampling, 4),
        "reference_forward_s": round(reference, 4), "training_s": round(training, 4),
        "critic_training_s": round(critic, 4), "other_s": round(other, 4),
        "sampling_frac": round(sampling / step, 4), "reference_forward_frac": round(reference / step, 4),
        "training_frac": round(training / step, 4), "critic_training_frac": round(critic / step, 4),
        "other_frac": round(other / step, 4),
        "generated_tokens_per_step": round(float(np.mean(generated)), 1),
        "sampled_tokens_per_s": round(sampled_tps, 1),
        "tokens_per_s": round(mean("tokens_per_s"), 1),
        "compile_step_s": round(records[0]["timing/step"], 3),
        "compile_step_split_s": {"sampling": records[0]["timing/generate"],
                                 "reference_forward": records[0]["timing/fwd_logprobs_values"],
                                 "training": records[0]["timing/policy_train"]},
        "setup_s": round(setup_s, 3),
        "compiles": sum(compiles.values()),
        "compiles_after_first_step": sum(compiles.values()) - compiles_after_first,
        "compiles_by_program": compiles,
        "avg_reward": round(mean("reward/avg_raw_reward"), 4),
        "peak_rss_bytes": rss.peak,
        "device": jax.devices()[0].device_kind,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", "--shape", nargs="+", choices=["tiny", "100m"], default=["tiny", "100m"],
                        help="model shapes to run, in order: 'tiny' = the built-in tiny model, '100m' = a random "
                             "Qwen3 checkpoint of the model-shape flags below (default: both)")
    parser.add_argument("--train-batch-size", type=int, default=8,
                        help="prompts per RL step (trainer.train_batch_size; also the mini-batch, so one "
                             "optimizer step per RL step; default: %(default)s)")
    parser.add_argument("--n-samples", type=int, default=8,
                        help="samples per prompt (generator.n_samples_per_prompt; default: %(default)s)")
    parser.add_argument("--max-generate-length", type=int, default=None,
                        help=f"max tokens sampled per response (default per shape: {DEFAULT_GENERATE})")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"RL steps per shape, the first (compiling) one excluded from the averages "
                             f"(default per shape: {DEFAULT_STEPS})")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank on all linear layers, alpha = 2 x rank (default: %(default)s)")
    parser.add_argument("--advantage-estimator", choices=["grpo", "gae"], default="grpo",
                        help="grpo, or gae: PPO with a critic (a second LoRA adapter of --rank with a value head; "
                             "its values join the reference forward's phase; default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=64,
                        help="sequences per training micro-batch (trainer.micro_train_batch_size_per_gpu; default: %(default)s)")
    add_model_args(parser, hidden=768, layers=8, heads=12, kv_heads=4, intermediate=2048, vocab=32000)
    for action in parser._actions:
        if action.dest in MODEL_FLAG_HELP:
            action.help = MODEL_FLAG_HELP[action.dest]
        elif action.dest == "head_dim":
            action.help = "head dim of the 100m shape's random model (default: hidden size / heads)"
    args = parser.parse_args()

    for shape in dict.fromkeys(args.shapes):
        if shape == "tiny":
            row = run_shape(shape, "tiny", None, args)
        else:
            with random_model(args) as (model_dir, params):
                row = run_shape(shape, str(model_dir), params, args)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
