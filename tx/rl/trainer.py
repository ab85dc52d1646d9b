"""The RL loop on the tx backend: sample with the adapters being trained, score in envs, train, repeat.

One training step (SkyRL's order, seed names), for every run of the job at once:
1. the next data batch of `trainer.train_batch_size` prompts (a seeded permutation per epoch: data batch N
   is always the same rows, so resuming is exact; `dynamic_sampling` may draw several),
   `generator.n_samples_per_prompt` episodes each, sampled with each run's current LoRA weights (no weight
   sync, no second engine; the sampler's log-probs are the "old" log-probs);
2. rewards from the envs (`zero_reward_on_non_stop`, `apply_overlong_filtering`, `zero_variance_filter`);
3. reference log-probs from the base model, adapter slot 0, in one forward (`use_kl_loss` /
   `use_kl_in_reward`; no copy of the weights);
4. advantages (`advantage_estimator`, `advantage_batch_normalize`; `gae` from the run's critic's values),
   off-policy correction; with `algorithm.temperature` != 1 every log-prob (old, reference, trained) is of
   softmax(logits / temperature), the old ones from one forward (the sampler's are untempered);
5. `update_epochs_per_batch` passes over the batch in mini-batches of `policy_mini_batch_size` prompts:
   one forward_backward per mini-batch (a request per run), then an AdamW step per run.

The per-token objective is the registered tx loss "tx.rl" (`tx.rl.objective`). The adapters live in this
process's backend or, with `tx.base_url`, on a `python -m tx.run` server driven through the tinker SDK
(`tx.rl.policy`): the same loop, the same numbers.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from tx import types
from tx.metrics import MetricsSink
from tx.backends.config import JaxBackendConfig, MixedPrecisionConfig
from tx.rl import algorithms, critic, objective, update
from tx.rl.batch import datum, from_targets
from tx.rl.config import RLConfig
from tx.rl.env import EnvPool, import_env_modules
from tx.rl.policy import LocalPolicy, RemotePolicy
from tx.rl.rollout import ChatTokens, PromptRow, RolloutParams, Trajectory, rollout
from tx.rl.update import Run
from tx.sft.data import load_rows
from tx.sft.seed_config import OptimizerConfig, lora_targets

logger = logging.getLogger(__name__)

LATEST = "latest_ckpt_global_step.txt"


def learning_rate(opt: OptimizerConfig, optimizer_step: int, total: int) -> float:
    """The seed's schedules over optimizer steps (HF semantics): linear warmup, then constant / cosine / linear."""
    if optimizer_step < opt.num_warmup_steps:
        return opt.lr * (optimizer_step + 1) / opt.num_warmup_steps
    if opt.scheduler == "constant_with_warmup":
        return opt.lr
    progress = (optimizer_step - opt.num_warmup_steps) / max(1, total - opt.num_warmup_steps)
    return opt.lr * (0.5 * (1 + math.cos(math.pi * progress)) if opt.scheduler == "cosine" else 1 - progress)


class RLTrainer:
    def __init__(self, cfg: RLConfig):
        from transformers import AutoTokenizer

        self.cfg = cfg
        t, g, a = cfg.trainer, cfg.generator, cfg.trainer.algorithm
        import_env_modules(cfg.environment.imports)
        base = t.policy.model.path
        if base == "tiny":
            from tx.score import tiny_model_dir

            base = str(tiny_model_dir())
        self.base_model = base
        objective.register_objective()  # over the policy losses registered now (environment.imports' too)
        self.runs = [Run.build(name, run_cfg) for name, run_cfg in cfg.run_configs().items()]
        ranks = [r.cfg.trainer.policy.model.lora.rank for r in self.runs]
        self.full = 0 in ranks  # rank 0: every base weight trains (one run; the config checks the rest)
        critics = [r for r in self.runs if r.critic]
        ranks += [r.cfg.trainer.critic.model.lora.rank for r in critics]
        # SkyRL's micro-batch is per GPU: a jit call, which spans the mesh, takes it times the fsdp size (a server's
        # mesh, with tx.base_url, is the server's own)
        fsdp = 1 if cfg.tx.base_url else cfg.tx.mesh_shape(jax.device_count(), jax.process_count()).fsdp
        config = JaxBackendConfig(
            training_mode="full" if self.full else "lora", **cfg.tx.mesh_sizes(),
            mixed_precision=MixedPrecisionConfig(param_dtype="bf16" if t.bf16 else "fp32") if self.full else None,
            dtype=None if self.full or t.bf16 else "float32",
            max_lora_adapters=cfg.tx.max_lora_adapters or len(self.runs) + len(critics) + 1,
            max_lora_rank=max(1, *ranks),
            max_seq_len=a.max_seq_len, train_micro_batch_size=t.micro_train_batch_size_per_gpu * fsdp,
            gradient_checkpointing=t.gradient_checkpointing, loss_chunk_size=cfg.tx.loss_chunk_size,
            max_num_samples=max(g.n_samples_per_prompt, g.eval_n_samples_per_prompt),
            **({"train_micro_batch_tokens": cfg.tx.micro_batch_tokens} if cfg.tx.micro_batch_tokens is not None else {}),
            **({"max_num_seqs": cfg.tx.max_num_seqs} if cfg.tx.max_num_seqs else {}))
        if cfg.tx.base_url:
            self.policy: LocalPolicy | RemotePolicy = RemotePolicy(cfg.tx.base_url, t.policy.model.path)
        else:
            kl = any(r.cfg.trainer.algorithm.use_kl_loss or r.cfg.trainer.algorithm.use_kl_in_reward for r in self.runs)
            self.policy = LocalPolicy(base, config, frozen_reference=self.full and kl)
            base = str(self.policy.model_dir)
        for run in self.runs:
            for model_id, lora in ((run.name, run.cfg.trainer.policy.model.lora),
                                   (run.critic, run.cfg.trainer.critic.model.lora)):
                if model_id:
                    self.policy.create(model_id, types.LoraConfig(
                        rank=lora.rank, alpha=lora.alpha, seed=run.cfg.trainer.seed,
                        **lora_targets(lora.target_modules, lora.exclude_modules)))
        tokenizer = AutoTokenizer.from_pretrained(base, use_fast=not t.disable_fast_tokenizer)
        self.chat = ChatTokens(tokenizer, g.chat_template_kwargs)
        self.dropped_rows: dict[str, int] = {}  # per split: prompts over trainer.max_prompt_length
        self.train_rows = self._load(cfg.data.train_data, "train")
        self.val_rows = self._load(cfg.data.val_data, "val") if t.eval_interval > 0 or t.eval_before_train else []
        self.steps_per_epoch = len(self.train_rows) // t.train_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"data.train_data holds {len(self.train_rows)} usable prompts, fewer than "
                             f"trainer.train_batch_size={t.train_batch_size}")
        self.total_steps = self.steps_per_epoch * t.epochs
        self.optimizer_steps_per_step = (t.train_batch_size // t.policy_mini_batch_size) * t.update_epochs_per_batch
        self.critic_steps_per_step = (t.train_batch_size // t.critic_mini_batch_size) * t.update_epochs_per_batch
        self.global_step = 0
        self.batches_used = 0  # data batches sampled so far: > global_step when dynamic sampling drew more
        self.pool = EnvPool(int(cfg.environment.skyrl_gym.get("max_env_workers", 32)))
        env_configs = {k: v for k, v in cfg.environment.skyrl_gym.items() if isinstance(v, dict)}
        self.rollout_params = {
            split: RolloutParams(
                n_samples=n, max_turns=g.max_turns, max_input_length=g.max_input_length, max_seq_len=a.max_seq_len,
                sampling=types.SamplingParams(
                    max_tokens=sp.max_generate_length, temperature=sp.temperature, top_p=sp.top_p,
                    top_k=sp.top_k, min_p=sp.min_p, repetition_penalty=sp.repetition_penalty,
                    stop=sp.stop if sp.stop else None),
                chat_template_kwargs=g.chat_template_kwargs, env_configs=env_configs)
            for split, sp, n in (("train", g.sampling_params, g.n_samples_per_prompt),
                                 ("eval", g.eval_sampling_params, g.eval_n_samples_per_prompt))}
        self.metrics = MetricsSink(cfg.tx.metrics_file, dict(project=t.project_name, name=t.run_name,
                                                             config=cfg.model_dump()) if t.logger == "wandb" else None)

    def _prefix(self, run: Run) -> str:
        """Metric keys are SkyRL's for a single run, '<run>/...' when the job has several."""
        return f"{run.name}/" if self.cfg.runs else ""

    # ---- data ----

    def _load(self, sources: list[str], split: str = "train") -> list[PromptRow]:
        """Rows of every source whose templated prompt fits `trainer.max_prompt_length`. Others are dropped, as
        SkyRL does, with a warning; their count is the `data/dropped_rows` (`data/dropped_val_rows`) metric."""
        rows, dropped = [], 0
        limit = self.cfg.trainer.max_prompt_length
        for source in sources:
            for row in load_rows(str(Path(source).expanduser()) if source.startswith("~") else source):
                if "prompt" not in row:
                    raise ValueError(f"{source}: every row needs a 'prompt' (a list of chat messages); got keys "
                                     f"{sorted(row)}")
                extras = {k: v for k, v in row.items() if k not in ("prompt", "env_class")}
                prompt = PromptRow(list(row["prompt"]), row.get("env_class") or self.cfg.environment.env_class, extras)
                if len(self.chat.prompt(prompt.prompt)) > limit:
                    dropped += 1
                    continue
                rows.append(prompt)
        if dropped:
            logger.warning("data.%s_data: %d of %d prompts are longer than trainer.max_prompt_length=%d tokens and "
                           "were dropped", split, dropped, dropped + len(rows), limit)
        self.dropped_rows[split] = dropped
        return rows

    def batch_rows(self, step: int) -> list[PromptRow]:
        """The prompts of global step `step` (0-based): a seeded permutation per epoch, last partial batch dropped."""
        size = self.cfg.trainer.train_batch_size
        epoch, within = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.cfg.trainer.seed, epoch]).permutation(len(self.train_rows))
        return [self.train_rows[i] for i in order[within * size:(within + 1) * size]]

    # ---- one step ----

    def train_step(self) -> dict[str, Any] | None:
        """One RL step of every run: their rollouts share sampling calls, their reference log-probs one forward,
        their mini-batches one forward_backward each. None when the data ran out (dynamic sampling)."""
        timing: dict[str, float] = {}
        start = time.perf_counter()
        record: dict[str, Any] = {"step": self.global_step + 1, "data/dropped_rows": self.dropped_rows["train"]}
        if self.dropped_rows.get("val"):
            record["data/dropped_val_rows"] = self.dropped_rows["val"]
        by_run = self._collect(record)
        if by_run is None:
            return None
        timing["generate"] = time.perf_counter() - start
        phase = time.perf_counter()
        kl_runs = [r for r in self.runs if r.cfg.trainer.algorithm.use_kl_loss or r.cfg.trainer.algorithm.use_kl_in_reward]
        refs = self._reference_logprobs({r.name: by_run[r.name] for r in kl_runs}) if kl_runs else {}
        olds = self._recomputed_logprobs({r.name: by_run[r.name] for r in self.runs
                                          if update.recomputes_old(r, self.full)})
        critics = {r.critic: by_run[r.name] for r in self.runs if r.critic}
        values = critic.old_values(self.policy, critics) if critics else {}
        timing["fwd_logprobs_values"] = time.perf_counter() - phase
        phase = time.perf_counter()
        prepared = {}
        for run in self.runs:
            trajectories = by_run[run.name]
            record |= {self._prefix(run) + k: v for k, v in self._rollout_metrics(trajectories).items()}
            prepared[run.name], metrics = update.prepare(run, trajectories, refs.get(run.name),
                                                         values.get(run.critic), olds.get(run.name))
            record |= {self._prefix(run) + k: v for k, v in metrics.items()}
        timing["compute_advantages_and_returns"] = time.perf_counter() - phase
        phase = time.perf_counter()
        if critics:
            for run_name, metrics in self._update_critics(by_run, prepared).items():
                record |= {self._prefix(self._run(run_name)) + k: v for k, v in metrics.items()}
            timing["critic_train"] = time.perf_counter() - phase
            phase = time.perf_counter()
        for run_name, metrics in self._update(by_run, prepared).items():
            record |= {self._prefix(self._run(run_name)) + k: v for k, v in metrics.items()}
        timing["policy_train"] = time.perf_counter() - phase
        self.global_step += 1
        elapsed = time.perf_counter() - start
        tokens = sum(len(tr.prompt_ids) + len(tr.response_ids) for trs in by_run.values() for tr in trs)
        record |= {f"timing/{k}": round(v, 4) for k, v in timing.items()}
        record |= {"timing/step": round(elapsed, 4), "tokens_per_s": round(tokens / elapsed, 1)}
        return record

    def _collect(self, record: dict[str, Any]) -> dict[str, list[Trajectory]] | None:
        """This step's episodes of every run: the next data batch's, or for a run with `dynamic_sampling` as many
        batches as it takes (`filter`: keep the groups whose rewards differ until `train_batch_size` of them;
        `replace`: once more than `min_replace_ratio` of a batch's groups are good, the others' rows become
        copies of good groups'). Each run keeps its own groups; a further batch is sampled only for the runs
        that still need one, and the data cursor moves past every batch drawn. None when the data ran out."""
        size, n = self.cfg.trainer.train_batch_size, self.cfg.generator.n_samples_per_prompt
        pending = {r.name: r for r in self.runs}
        kept: dict[str, list[list[Trajectory]]] = {name: [] for name in pending}
        tries = dict.fromkeys(pending, 0)
        while pending:
            if self.batches_used >= self.total_steps:
                return None
            batch = self.batches_used
            out = rollout(self.policy, self.chat, {name: (r.cfg.trainer.seed, batch) for name, r in pending.items()},
                          self.batch_rows(batch), self.rollout_params["train"], self.pool)
            self.batches_used += 1
            for name, trajectories in out.items():
                run, ds = pending[name], pending[name].cfg.trainer.algorithm.dynamic_sampling
                tries[name] += 1
                groups: dict[int, list[Trajectory]] = {}
                for tr in trajectories:
                    groups.setdefault(tr.group, []).append(tr)
                done = ds.type is None
                if done:
                    kept[name] = list(groups.values())
                else:
                    good_b = algorithms.dynamic_sampling_filter([tr.reward for tr in trajectories],
                                                                [tr.group for tr in trajectories], n)
                    good_g = {tr.group for tr, ok in zip(trajectories, good_b) if ok}
                    good = [g for key, g in groups.items() if key in good_g]
                    if ds.type == "filter":
                        kept[name] += good
                        done = len(kept[name]) >= size
                        kept[name] = kept[name][:size]
                    elif len(good) > len(groups) * ds.min_replace_ratio:
                        rng = np.random.default_rng([run.cfg.trainer.seed, batch + 1, 2])
                        bad = [key for key in groups if key not in good_g]
                        picks = rng.choice(len(good), len(bad), replace=len(bad) > len(good))
                        for key, pick in zip(bad, picks):
                            groups[key] = [replace(tr) for tr in good[pick]]
                        kept[name], done = list(groups.values()), True
                    if not done and ds.max_sample_batches > 0 and tries[name] >= ds.max_sample_batches:
                        raise RuntimeError(f"{self._prefix(run)}trainer.algorithm.dynamic_sampling: {tries[name]} "
                                           f"batches sampled (max_sample_batches={ds.max_sample_batches}) without "
                                           "enough prompts whose rewards differ")
                if done:
                    del pending[name]
        for run in self.runs:
            for group, members in enumerate(kept[run.name]):
                for tr in members:
                    tr.group = group
            if run.cfg.trainer.algorithm.dynamic_sampling.type:
                record[self._prefix(run) + "dynamic_sampling/sampled_batches"] = tries[run.name]
        return {name: [tr for members in kept[name] for tr in members] for name in kept}

    def _model_ids(self) -> list[str]:
        """Every adapter the job trains: each run's policy, and its critic if it has one."""
        return [m for r in self.runs for m in (r.name, r.critic) if m]

    def _run(self, name: str) -> Run:
        return next(r for r in self.runs if r.name == name)

    def _reference_logprobs(self, by_run: dict[str, list[Trajectory]]) -> dict[str, np.ndarray]:
        """log p_base(response token) [B, T] per run, from the base model (slot 0) in one forward."""
        trajectories = [tr for trs in by_run.values() for tr in trs]
        temperatures = [self._run(name).cfg.trainer.algorithm.temperature for name, trs in by_run.items() for _ in trs]
        outputs = iter(self.policy.base_logprobs([tr.prompt_ids + tr.response_ids for tr in trajectories],
                                                 temperatures))
        return {name: from_targets(trs, [next(outputs) for _ in trs]) for name, trs in by_run.items()}

    def _recomputed_logprobs(self, by_run: dict[str, list[Trajectory]]) -> dict[str, np.ndarray]:
        """Old log-probs [B, T] from a forward of the runs' own weights, one pass for all, where the sampler's
        are not the update's: `algorithm.temperature` != 1 (the sampler's are untempered), and full training
        (bf16 weights: the decode loop and the training pass round differently)."""
        if not by_run:
            return {}
        temperature = {name: self._run(name).cfg.trainer.algorithm.temperature for name in by_run}
        out = self.policy.forward({name: ([datum(tr) | {"temperature": temperature[name]} for tr in trs],
                                          "cross_entropy", None) for name, trs in by_run.items()})
        return {name: from_targets(trs, [o["logprobs"] for o in out[name].outputs]) for name, trs in by_run.items()}

    def _update(self, by_run: dict[str, list[Trajectory]], prepared: dict[str, dict]) -> dict[str, dict[str, float]]:
        """`update_epochs_per_batch` passes of mini-batches; each mini-batch is one forward_backward holding every
        run's rows (a request per run), then an AdamW step per run."""
        t = self.cfg.trainer
        rows_per_mini = t.policy_mini_batch_size * self.cfg.generator.n_samples_per_prompt
        rows = len(next(iter(by_run.values())))
        sums: dict[str, dict[str, list[float]]] = {r.name: {} for r in self.runs}
        rngs = {r.name: np.random.default_rng([r.cfg.trainer.seed, self.global_step, 1]) for r in self.runs}
        optimizer_step = self.global_step * self.optimizer_steps_per_step
        for _ in range(t.update_epochs_per_batch):
            for lo in range(0, rows, rows_per_mini):
                idx = np.arange(lo, min(lo + rows_per_mini, rows))
                requests = {r.name: update.minibatch(r, by_run[r.name], prepared[r.name], idx, rngs[r.name])
                            for r in self.runs}
                out = self.policy.forward_backward(requests)
                for run in self.runs:
                    result = out[run.name]
                    lr, grad_norm = self._adam_step(run.name, run.cfg.trainer.policy.optimizer_config, optimizer_step,
                                                    self.total_steps * self.optimizer_steps_per_step)
                    trajectories, prep = by_run[run.name], prepared[run.name]
                    width = prep["mask"].shape[1]
                    rows_tr = [trajectories[i] for i in idx]
                    current = from_targets(rows_tr, [o["logprobs"] for o in result.outputs], width)
                    entropy = from_targets(rows_tr, [o["entropy"] for o in result.outputs], width)
                    for key, value in update.loss_metrics(run, prep, idx, current, entropy).items():
                        sums[run.name].setdefault(key, []).append(value)
                    sums[run.name].setdefault("policy/policy_loss", []).append(result.loss_sum)
                    sums[run.name].setdefault("policy/grad_norm", []).append(grad_norm)
                    sums[run.name].setdefault("policy/policy_lr", []).append(lr)
                optimizer_step += 1
        return {name: {k: float(np.mean(v)) for k, v in s.items()} for name, s in sums.items()}

    def _adam_step(self, model_id: str, opt: OptimizerConfig, step: int, total: int) -> tuple[float, float]:
        """One AdamW step of `model_id` at the schedule's learning rate for optimizer step `step` of `total`:
        (learning rate, gradient norm)."""
        lr = learning_rate(opt, step, total)
        return lr, self.policy.optim_step(model_id, types.AdamParams(
            learning_rate=lr, beta1=opt.adam_betas[0], beta2=opt.adam_betas[1], weight_decay=opt.weight_decay,
            grad_clip_norm=opt.max_grad_norm))

    def _update_critics(self, by_run: dict[str, list[Trajectory]], prepared: dict[str, dict]) -> dict[str, dict]:
        """The critics' `update_epochs_per_batch` passes in mini-batches of `critic_mini_batch_size` prompts: one
        forward_backward per mini-batch holding every critic's rows, then an AdamW step per critic."""
        t = self.cfg.trainer
        runs = [r for r in self.runs if r.critic]
        rows_per_mini = t.critic_mini_batch_size * self.cfg.generator.n_samples_per_prompt
        rows = len(by_run[runs[0].name])
        sums: dict[str, dict[str, list[float]]] = {r.name: {} for r in runs}
        step = self.global_step * self.critic_steps_per_step
        for _ in range(t.update_epochs_per_batch):
            for lo in range(0, rows, rows_per_mini):
                idx = np.arange(lo, min(lo + rows_per_mini, rows))
                out = self.policy.forward_backward({r.critic: critic.value_datums(
                    by_run[r.name], idx, prepared[r.name], r.cfg.trainer.algorithm.value_clip) for r in runs})
                for run in runs:
                    lr, grad_norm = self._adam_step(run.critic, run.cfg.trainer.critic.optimizer_config, step,
                                                    self.total_steps * self.critic_steps_per_step)
                    prep, result = prepared[run.name], out[run.critic]
                    current = from_targets([by_run[run.name][i] for i in idx], [o["values"] for o in result.outputs],
                                           prep["mask"].shape[1])
                    clipfrac = algorithms.value_clip_fraction(current, prep["values"][idx], prep["returns"][idx],
                                                              prep["mask"][idx], run.cfg.trainer.algorithm.value_clip)
                    for key, value in (("critic/critic_loss", result.loss_sum), ("critic/grad_norm", grad_norm),
                                       ("critic/critic_lr", lr), ("critic/vf_clipfrac", clipfrac)):
                        sums[run.name].setdefault(key, []).append(value)
                step += 1
        return {name: {k: float(np.mean(v)) for k, v in s.items()} for name, s in sums.items()}

    def _rollout_metrics(self, trajectories: list[Trajectory]) -> dict[str, Any]:
        rewards = np.array([tr.reward for tr in trajectories])
        lengths = np.array([tr.generated_tokens() for tr in trajectories])
        groups: dict[int, list[float]] = {}
        for tr in trajectories:
            groups.setdefault(tr.group, []).append(tr.reward)
        n = max(len(v) for v in groups.values())
        errors = sum(len(tr.env_errors) for tr in trajectories)
        return {"reward/avg_raw_reward": float(rewards.mean()), "reward/std_raw_reward": float(rewards.std()),
                f"reward/avg_pass_at_{n}": float(np.mean([max(v) > 0 for v in groups.values()])),
                "generate/avg_num_tokens": float(lengths.mean()), "generate/max_num_tokens": int(lengths.max()),
                "generate/stop_ratio": float(np.mean([tr.stop_reason == "stop" for tr in trajectories])),
                **({"environment/errors": errors} if errors else {})}

    def evaluate(self) -> dict[str, Any]:
        """Every validation prompt, `eval_n_samples_per_prompt` episodes with `eval_sampling_params`, per run."""
        if not self.val_rows:
            return {}
        size = self.cfg.trainer.eval_batch_size
        by_run: dict[str, list[Trajectory]] = {r.name: [] for r in self.runs}
        for lo in range(0, len(self.val_rows), size):
            part = rollout(self.policy, self.chat, {r.name: (r.cfg.trainer.seed, -1, lo) for r in self.runs},
                           self.val_rows[lo:lo + size], self.rollout_params["eval"], self.pool)
            for name, trajectories in part.items():
                for tr in trajectories:
                    tr.group += lo
                by_run[name] += trajectories
        out: dict[str, Any] = {"step": self.global_step}
        for run in self.runs:
            metrics = self._rollout_metrics(by_run[run.name])
            metrics["avg_score"] = metrics.pop("reward/avg_raw_reward")
            out |= {f"{self._prefix(run)}eval/all/{k}": v for k, v in metrics.items()}
        return out

    # ---- checkpoints and exports ----

    def save(self) -> Path:
        t = self.cfg.trainer
        root = Path(t.ckpt_path).expanduser()
        step_dir = root / f"global_step_{self.global_step}"
        states = {model_id: self.policy.save(model_id, step_dir / model_id) for model_id in self._model_ids()}
        step_dir.mkdir(parents=True, exist_ok=True)
        (step_dir / "trainer_state.json").write_text(json.dumps({
            "global_step": self.global_step, "batches_used": self.batches_used,
            "kl_coef": {r.name: r.kl_ctrl.value for r in self.runs}, "policy_state": states,
            "config": self.cfg.model_dump()}))
        (root / LATEST).write_text(str(self.global_step))  # last: a crash before it leaves the previous one
        if t.max_ckpts_to_keep > 0:
            steps = sorted(int(p.name.split("_")[-1]) for p in root.glob("global_step_*"))
            for old in steps[: -t.max_ckpts_to_keep]:
                shutil.rmtree(root / f"global_step_{old}", ignore_errors=True)
        return step_dir

    def resume(self) -> None:
        t = self.cfg.trainer
        if t.resume_mode in (None, "none"):
            return
        if t.resume_mode == "latest":
            marker = Path(t.ckpt_path).expanduser() / LATEST
            if not marker.exists():
                return
            target = marker.parent / f"global_step_{marker.read_text().strip()}"
        else:
            target = Path(t.resume_path).expanduser()
        state = json.loads((target / "trainer_state.json").read_text())
        for model_id in self._model_ids():
            self.policy.load(model_id, target / model_id, state.get("policy_state", {}).get(model_id, {}))
        for run in self.runs:
            run.kl_ctrl.value = state["kl_coef"][run.name]
        self.global_step = state["global_step"]
        self.batches_used = state.get("batches_used", self.global_step)

    def export(self, path: Path) -> None:
        """Each run as a PEFT adapter at <path>/<run>/ (<path>/policy/ for a single run)."""
        for run in self.runs:
            self.policy.export(run.name, self.base_model, path / run.name)

    def log(self, record: dict[str, Any]) -> None:
        self.metrics.log(record)

    def fit(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train to the end (or `stop_after` steps, to simulate an interruption); return a summary."""
        t = self.cfg.trainer
        self.resume()
        if t.eval_before_train and self.global_step == 0 and self.val_rows:
            self.log(self.evaluate())
        bar = tqdm(total=self.total_steps, initial=self.batches_used, desc="rl", unit="batch", disable=None)
        done = 0
        try:
            while self.batches_used < self.total_steps and (stop_after is None or done < stop_after):
                used = self.batches_used
                record = self.train_step()
                if record is None:  # dynamic sampling ran out of data
                    break
                done += 1
                step = self.global_step
                if t.ckpt_interval > 0 and step % t.ckpt_interval == 0:
                    self.save()
                if t.hf_save_interval > 0 and step % t.hf_save_interval == 0:
                    self.export(Path(t.export_path).expanduser() / f"global_step_{step}")
                if t.eval_interval > 0 and (step % t.eval_interval == 0 or self.batches_used >= self.total_steps):
                    record |= self.evaluate()
                self.log(record)
                bar.update(self.batches_used - used)
                rewards = [v for k, v in record.items() if k.endswith("reward/avg_raw_reward")]
                bar.set_postfix({"reward": round(float(np.mean(rewards)), 3), "tok/s": record["tokens_per_s"]})
        finally:
            bar.close()
        if self.batches_used < self.total_steps:
            return {"interrupted_at": self.global_step}
        if t.ckpt_interval > 0 and self.global_step % t.ckpt_interval:
            self.save()
        if t.hf_save_interval > 0 and self.global_step % t.hf_save_interval:
            self.export(Path(t.export_path).expanduser() / f"global_step_{self.global_step}")
        summary = {"summary": True, "steps": self.global_step}
        self.log(summary)
        self.metrics.close()
        return summary
