"""The SFT loop on the tx backend: several runs (adapters) train concurrently in shared, packed batches.

Each step takes the next `batch_size` examples (a seeded permutation per epoch, so step N always sees the
same data: resuming is exact), packs them into rows, and sends one forward_backward whose rows are
repeated once per run, each copy on that run's adapter. Weights are divided by the step's number of
trained tokens, so `loss:sum` is the mean token cross-entropy. Then each run takes its own AdamW step
with its own learning-rate schedule.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import jax

from tx import types
from tx.metrics import MetricsSink
from tx.backends.config import JaxBackendConfig
from tx.backends.full import backend_class
from tx.backends.jax import JaxBackend
from tx.checkpoints import peft_format
from tx.checkpoints.full import export_hf_model
from tx.sft.config import SFTConfig
from tx.sft.data import dummy_examples, load_examples, packed_rows
from tx.training import step_dirs
from tx.training.data import batch_indices
from tx.training.progress import progress_bar
from tx.training.schedule import learning_rate


class SFTTrainer:
    def __init__(self, cfg: SFTConfig):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.progress: bool | None = None  # the progress bar: None = where stderr is a terminal
        base = cfg.base_model
        if base == "tiny":
            from tx.score import tiny_model_dir

            base = str(tiny_model_dir())
        self.base_model = base
        mesh = cfg.mesh_shape(jax.device_count(), jax.process_count())  # refused here in this config's names
        per_device = cfg.micro_batch_rows_per_device
        micro_rows = cfg.micro_batch_rows if per_device is None else per_device * mesh.fsdp
        if micro_rows % mesh.fsdp:
            raise ValueError(f"micro_batch_rows={cfg.micro_batch_rows} must be a multiple of the mesh's fsdp size "
                             f"{mesh.fsdp} (mesh fsdp={mesh.fsdp} ep={mesh.ep} tp={mesh.tp} over {mesh.num_devices} "
                             "devices): each call's rows are split over the fsdp devices; set micro_batch_rows or "
                             "fsdp_size")
        config = JaxBackendConfig(
            training_mode=cfg.training_mode,  # rank 0: every base weight is trained (FullBackend)
            mixed_precision=cfg.mixed_precision if cfg.training_mode == "full" else None,
            **cfg.mesh_sizes(),  # a size left None: the backend's default (fsdp: every device ep x tp leave)
            max_lora_adapters=cfg.max_lora_adapters or len(cfg.runs) + 1,
            max_lora_rank=max(1, *(r.rank for r in cfg.runs)),
            train_micro_batch_tokens=cfg.micro_batch_tokens,
            train_micro_batch_size=micro_rows,
            max_seq_len=max(cfg.pack_length or 0, cfg.data.max_length or 0) or None,
            loss_chunk_size=cfg.loss_chunk_size,
            gradient_checkpointing=cfg.gradient_checkpointing,
            remat_policy=cfg.remat_policy,
            attention_impl=cfg.attention_impl,
            moe_impl=cfg.moe_impl,
        )
        self.backend: JaxBackend = backend_class(config)(base, config)
        tokenizer = AutoTokenizer.from_pretrained(str(self.backend.model_dir))
        cache = None if cfg.disable_cache else cfg.cache_dir
        self.cache_hits = 0
        if cfg.dummy_run_full_ctx:
            self.train = dummy_examples(cfg.batch_size, cfg.data.max_length, self.backend.model.config.vocab_size)
            self.train_by_run = {run.name: self.train for run in cfg.runs}
            self.eval = []
        else:
            loaded: dict[str, list] = {}
            for source in dict.fromkeys([cfg.data.dataset] + [r.dataset for r in cfg.runs if r.dataset]):
                loaded[source], hit = load_examples(source, cfg.data.split, tokenizer, cfg.data, cache, cfg.force_recache)
                self.cache_hits += hit
            self.train = loaded[cfg.data.dataset]
            self.train_by_run = {run.name: loaded[run.dataset or cfg.data.dataset] for run in cfg.runs}
            self.eval = []
            if cfg.data.eval_dataset:
                self.eval, hit = load_examples(cfg.data.eval_dataset, cfg.data.eval_split, tokenizer, cfg.data, cache,
                                               cfg.force_recache)
                self.cache_hits += hit
        for run in cfg.runs:
            self.backend.create_model(run.name, types.LoraConfig(
                rank=run.rank, alpha=run.alpha, seed=run.seed, train_attn=run.train_attn,
                train_mlp=run.train_mlp, train_unembed=run.train_unembed))
        self.steps_per_epoch = math.ceil(len(self.train) / cfg.batch_size)
        self.total_steps = (cfg.dummy_run_max_steps if cfg.dummy_run_full_ctx
                            else cfg.num_steps or cfg.num_epochs * self.steps_per_epoch)
        self.step = 0
        self.metrics = MetricsSink(cfg.metrics_file, dict(
            project=cfg.wandb_project, name=cfg.wandb_run_name, tags=cfg.wandb_tags, config=cfg.model_dump(),
        ) if cfg.wandb_project else None)

    # ---- data ----

    def batch_indices(self, step: int, size: int | None = None) -> list[int]:
        """The examples of `step` in a dataset of `size` (default: the job's): a seeded permutation per epoch."""
        size = size or len(self.train)
        return batch_indices(self.cfg.seed, step, size, self.cfg.batch_size,
                             math.ceil(size / self.cfg.batch_size)).tolist()

    def _batch(self, examples_by_run: dict[str, list], normalise: bool) -> types.PreparedModelPassBatch:
        """One datum list holding every run's packed rows, each run's rows on its own adapter."""
        fields: dict[str, list] = {k: [] for k in ("all_input_ids", "all_targets", "all_token_weights", "all_sampling_logprobs",
                                                   "all_advantages", "all_model_ids", "all_loss_fns", "all_loss_fn_configs",
                                                   "all_segment_ids")}
        slices = []
        for run in self.cfg.runs:
            rows = packed_rows(examples_by_run[run.name],
                               (self.cfg.pack_length or self.cfg.data.max_length) if self.cfg.packing else None)
            scale = 1.0 / sum(float(r["weights"].sum()) for r in rows) if normalise else 1.0
            start = len(fields["all_input_ids"])
            for r in rows:
                fields["all_input_ids"].append(r["input_ids"].tolist())
                fields["all_targets"].append(r["targets"].tolist())
                fields["all_token_weights"].append((r["weights"] * scale).tolist())
                fields["all_sampling_logprobs"].append([])
                fields["all_advantages"].append([])
                fields["all_model_ids"].append(run.name)
                fields["all_loss_fns"].append("cross_entropy")
                fields["all_loss_fn_configs"].append(None)
                fields["all_segment_ids"].append(r["segment_ids"].tolist())
            slices.append((run.name, run.name, start, len(fields["all_input_ids"])))
        return types.PreparedModelPassBatch(**fields, request_batch_slices=slices)

    # ---- steps ----

    def train_step(self) -> dict[str, Any]:
        start = time.perf_counter()
        by_run = {name: [data[i] for i in self.batch_indices(self.step, len(data))]
                  for name, data in self.train_by_run.items()}
        out = self.backend.forward_backward(self._batch(by_run, normalise=True))
        record: dict[str, Any] = {"step": self.step + 1,
                                  "tokens": int(sum(e.weights.sum() for ex in by_run.values() for e in ex))}
        for run in self.cfg.runs:
            result = out[run.name]
            if isinstance(result, types.ErrorResponse):
                raise RuntimeError(f"run {run.name}: {result.error}")
            opt = self.cfg.optimizer
            lr = learning_rate(run.learning_rate, self.step, self.total_steps, opt.scheduler, opt.warmup_steps,
                               opt.min_lr_ratio)
            metrics = self.backend.optim_step(run.name, types.OptimStepInput(adam_params=types.AdamParams(
                learning_rate=lr, beta1=opt.beta1, beta2=opt.beta2, eps=opt.eps, weight_decay=run.weight_decay,
                grad_clip_norm=opt.grad_clip_norm))).metrics
            record[f"{run.name}/loss"] = result.metrics["loss:sum"]
            record[f"{run.name}/lr"] = lr
            record[f"{run.name}/grad_norm"] = metrics["grad_norm"]
        elapsed = time.perf_counter() - start
        record |= {"step_time_s": round(elapsed, 4), "tokens_per_s": round(record["tokens"] / elapsed, 1)}
        self.step += 1
        return record

    def evaluate(self) -> dict[str, Any]:
        """Token-weighted mean cross-entropy of each run on the eval set."""
        if not self.eval:
            return {}
        out = self.backend.forward(self._batch({r.name: self.eval for r in self.cfg.runs}, normalise=False))
        total = sum(float(e.weights.sum()) for e in self.eval)
        return {"step": self.step, **{f"{r.name}/eval_loss": out[r.name].metrics["loss:sum"] / total for r in self.cfg.runs}}

    # ---- checkpoints and exports ----

    def save(self) -> Path:
        step_dir = step_dirs.step_dir(self.cfg.ckpt_path, self.step)
        for run in self.cfg.runs:
            self.backend.save_checkpoint(step_dir / run.name, run.name)
        state = {"step": self.step, "runs": [r.name for r in self.cfg.runs]}
        return step_dirs.commit(self.cfg.ckpt_path, self.step, state, keep=self.cfg.max_ckpts_to_keep)

    def resume(self) -> None:
        target = step_dirs.resume_dir(self.cfg.ckpt_path, self.cfg.resume_from)
        if target is None:
            return  # nothing asked for, or nothing saved yet: start fresh
        state = step_dirs.read_state(target)
        for run in self.cfg.runs:
            self.backend.load_checkpoint(target / run.name, run.name)
        self.step = state["step"]

    def export(self, path: str | Path) -> None:
        """Each run's PEFT adapter at <path>/<run>/; a rank-0 run's whole model as an HF directory there."""
        if self.cfg.training_mode == "full":
            run = self.cfg.runs[0].name
            export_hf_model(Path(path) / run, self.backend.model, self.backend.model_dir)
            return
        for run in self.cfg.runs:
            meta = self.backend.models[run.name]
            peft_format.export_adapter(self.backend.model, meta.adapter_index, meta.lora_config.rank,
                                       meta.lora_config.alpha, self.base_model, Path(path) / run.name)

    def log(self, record: dict[str, Any]) -> None:
        self.metrics.log(record)

    def fit(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train to the end (or `stop_after` steps, to simulate an interruption); return a summary."""
        self.resume()
        if self.cfg.eval_before_train and self.step == 0:
            self.log(self.evaluate())
        bar = progress_bar(self.total_steps, self.step, "sft", "step", self.progress)
        done = 0
        while self.step < self.total_steps and (stop_after is None or done < stop_after):
            record = self.train_step()
            done += 1
            self.log(record)
            bar.update(1)
            bar.set_postfix({k: round(v, 4) for k, v in record.items() if k.endswith("/loss")} | {"tok/s": record["tokens_per_s"]})
            if self.cfg.eval_interval and self.step % self.cfg.eval_interval == 0:
                self.log(self.evaluate())
            if self.cfg.ckpt_path and self.cfg.ckpt_interval and self.step % self.cfg.ckpt_interval == 0:
                self.save()
            if self.cfg.hf_save_interval and self.step % self.cfg.hf_save_interval == 0:
                self.export(step_dirs.step_dir(self.cfg.export_path, self.step))
        bar.close()
        if self.step < self.total_steps:
            return {"interrupted_at": self.step}
        summary = {"summary": True, "steps": self.step, **self.evaluate()}
        if self.cfg.ckpt_path:
            self.save()
        if self.cfg.export_path:
            self.export(self.cfg.export_path)
            if self.cfg.export_merged:
                from tx.export import merge

                for run in self.cfg.runs:
                    merge(self.base_model, str(Path(self.cfg.export_path) / run.name),
                          Path(self.cfg.export_path) / f"{run.name}-merged")
        self.log(summary)
        self.metrics.close()
        return summary
