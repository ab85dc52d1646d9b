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

The trainer wires config -> backend -> policy -> tokenizer -> data -> env pool -> metrics and runs the steps; each
job of a step has its module: rollout collection with dynamic sampling (`tx.rl.collect`), rewards -> advantages
(`tx.rl.prepare`, pure numpy), the one mini-batch loop of the policy and critic updates (`tx.rl.learner`, with
their learners in `tx.rl.update` and `tx.rl.critic`), checkpoints and exports (`tx.rl.checkpoint`).
The per-token objective of policy loss p is the registered tx loss "tx.rl.policy.<p>" (`tx.rl.objective`). The
adapters live in this process's backend or, with `tx.base_url`, on a `python -m tx.run` server driven through the tinker SDK
(`tx.rl.policy`): the same loop, the same numbers.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tx import types
from tx.metrics import MetricsSink
from tx.backends.config import JaxBackendConfig, MixedPrecisionConfig
from tx.rl import checkpoint, collect, critic, learner, update
from tx.rl.batch import datum, from_targets
from tx.rl.config import RLConfig
from tx.rl.env import EnvPool, import_env_modules
from tx.rl.policy import LocalPolicy, RemotePolicy
from tx.rl.prepare import prepare
from tx.rl.rollout import ChatTokens, PromptRow, RolloutParams, Trajectory, rollout
from tx.rl.runs import Run, recomputes_old
from tx.training.data import batch_indices, load_rows
from tx.training.progress import progress_bar
from tx.training.seed_config import lora_targets

logger = logging.getLogger(__name__)


class RLTrainer:
    def __init__(self, cfg: RLConfig):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.progress: bool | None = None  # the progress bar: None = where stderr is a terminal
        t, g, a = cfg.trainer, cfg.generator, cfg.trainer.algorithm
        import_env_modules(cfg.environment.imports)
        base = t.policy.model.path
        if base == "tiny":
            from tx.score import tiny_model_dir

            base = str(tiny_model_dir())
        self.base_model = base
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
        t = self.cfg.trainer
        return [self.train_rows[i] for i in batch_indices(t.seed, step, len(self.train_rows), t.train_batch_size,
                                                           self.steps_per_epoch)]

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
                                          if recomputes_old(r, self.full)})
        critics = {r.critic: by_run[r.name] for r in self.runs if r.critic}
        values = critic.old_values(self.policy, critics) if critics else {}
        timing["fwd_logprobs_values"] = time.perf_counter() - phase
        phase = time.perf_counter()
        prepared = {}
        for run in self.runs:
            trajectories = by_run[run.name]
            record |= {self._prefix(run) + k: v for k, v in collect.rollout_metrics(trajectories).items()}
            prepared[run.name], metrics = prepare(run, trajectories, refs.get(run.name), values.get(run.critic),
                                                  olds.get(run.name))
            record |= {self._prefix(run) + k: v for k, v in metrics.items()}
        timing["compute_advantages_and_returns"] = time.perf_counter() - phase
        phase = time.perf_counter()
        t, rows = self.cfg.trainer, len(next(iter(by_run.values())))
        if critics:
            record |= self._train({r.name: critic.learner(r.critic, r.cfg.trainer.critic.optimizer_config,
                                                          by_run[r.name], prepared[r.name],
                                                          r.cfg.trainer.algorithm.value_clip)
                                   for r in self.runs if r.critic},
                                  rows, t.critic_mini_batch_size, self.critic_steps_per_step)
            timing["critic_train"] = time.perf_counter() - phase
            phase = time.perf_counter()
        record |= self._train({r.name: update.learner(r, by_run[r.name], prepared[r.name],
                                                      np.random.default_rng([r.cfg.trainer.seed, self.global_step, 1]))
                               for r in self.runs}, rows, t.policy_mini_batch_size, self.optimizer_steps_per_step)
        timing["policy_train"] = time.perf_counter() - phase
        self.global_step += 1
        elapsed = time.perf_counter() - start
        tokens = sum(len(tr.prompt_ids) + len(tr.response_ids) for trs in by_run.values() for tr in trs)
        record |= {f"timing/{k}": round(v, 4) for k, v in timing.items()}
        record |= {"timing/step": round(elapsed, 4), "tokens_per_s": round(tokens / elapsed, 1)}
        return record

    def _collect(self, record: dict[str, Any]) -> dict[str, list[Trajectory]] | None:
        """This step's episodes of every run: the next data batch's, or for a run with `dynamic_sampling` as many
        batches as it takes (`tx.rl.collect`); the data cursor moves past every batch drawn. None when the data
        ran out."""
        return collect.collect(self.runs, self._draw, self.cfg.trainer.train_batch_size,
                               self.cfg.generator.n_samples_per_prompt, record, self._prefix)

    def _draw(self, runs: dict[str, Run]) -> tuple[int, dict[str, list[Trajectory]]] | None:
        """The next data batch's episodes of `runs`, each with its own sampling seed; None when the data ran out."""
        if self.batches_used >= self.total_steps:
            return None
        batch = self.batches_used
        out = rollout(self.policy, self.chat, {name: (r.cfg.trainer.seed, batch) for name, r in runs.items()},
                      self.batch_rows(batch), self.rollout_params["train"], self.pool)
        self.batches_used += 1
        return batch, out

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

    def _train(self, learners: dict[str, learner.Learner], rows: int, mini_batch_prompts: int,
               steps_per_step: int) -> dict[str, float]:
        """`update_epochs_per_batch` passes of `learners` (one per run) over the step's `rows` rows in mini-batches
        of `mini_batch_prompts` prompts (`tx.rl.learner`), their optimizer steps counted across the whole job; the
        metrics under each run's prefix."""
        t = self.cfg.trainer
        by_run = learner.train(self.policy, learners, rows,
                               mini_batch_prompts * self.cfg.generator.n_samples_per_prompt,
                               t.update_epochs_per_batch, self.global_step * steps_per_step,
                               self.total_steps * steps_per_step)
        return {self._prefix(self._run(name)) + k: v for name, metrics in by_run.items() for k, v in metrics.items()}

    def evaluate(self) -> dict[str, Any]:
        """Every validation prompt, `eval_n_samples_per_prompt` episodes with `eval_sampling_params`, per run."""
        if not self.val_rows:
            return {}
        by_run = collect.collect_eval(self.policy, self.chat, self.runs, self.val_rows,
                                      self.cfg.trainer.eval_batch_size, self.rollout_params["eval"], self.pool)
        out: dict[str, Any] = {"step": self.global_step}
        for run in self.runs:
            metrics = collect.rollout_metrics(by_run[run.name])
            metrics["avg_score"] = metrics.pop("reward/avg_raw_reward")
            out |= {f"{self._prefix(run)}eval/all/{k}": v for k, v in metrics.items()}
        return out

    # ---- checkpoints and exports ----

    def save(self) -> Path:
        return checkpoint.save(self.policy, self.cfg, self.runs, self.global_step, self.batches_used)

    def resume(self) -> None:
        resumed = checkpoint.resume(self.policy, self.cfg, self.runs)
        if resumed is not None:
            self.global_step, self.batches_used = resumed

    def export(self, path: Path) -> None:
        """Each run as a PEFT adapter at <path>/<run>/ (<path>/policy/ for a single run)."""
        checkpoint.export(self.policy, self.runs, self.base_model, path)

    def log(self, record: dict[str, Any]) -> None:
        self.metrics.log(record)

    def fit(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train to the end (or `stop_after` steps, to simulate an interruption); return a summary."""
        t = self.cfg.trainer
        self.resume()
        if t.eval_before_train and self.global_step == 0 and self.val_rows:
            self.log(self.evaluate())
        bar = progress_bar(self.total_steps, self.batches_used, "rl", "batch", self.progress)
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
                    self.export(checkpoint.export_dir(self.cfg, step))
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
            self.export(checkpoint.export_dir(self.cfg, self.global_step))
        summary = {"summary": True, "steps": self.global_step}
        self.log(summary)
        self.metrics.close()
        return summary
