"""SFTConfig: everything an SFT job needs, validated (unknown keys and bad values name the field)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tx.backends.config import DEFAULT_MICRO_BATCH_TOKENS, MixedPrecisionConfig
from tx.sft.masks import TrainOnWhat
from tx.training.mesh import MeshFields


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunConfig(_Strict):
    """One adapter trained by the job. Several runs train concurrently in shared batches."""

    name: str = Field("main", pattern=r"^[A-Za-z0-9_.-]+$", description="run name (directory and metric prefix)")
    rank: int = Field(16, ge=0, description="LoRA rank; 0 = full training (all weights, one run only)")
    alpha: float = Field(32.0, gt=0)
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    learning_rate: float = Field(1e-4, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    dataset: str | None = Field(None, description="this run's own training data (default: data.dataset); "
                                "it is cycled for the job's number of steps")


class OptimizerConfig(_Strict):
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip_norm: float = Field(1.0, ge=0, description="0 = no clipping")
    scheduler: Literal["constant_with_warmup", "cosine", "linear"] = "constant_with_warmup"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine/linear decay floor, as a fraction of lr")


class DataConfig(_Strict):
    dataset: str = Field(description="JSONL / Parquet / Arrow file or directory, or a Hugging Face dataset name")
    split: str = "train"
    messages_key: str = "messages"
    tools_key: str = "tools"
    system_key: str | None = Field(None, description="column holding a system prompt to prepend")
    max_length: int | None = Field(2048, ge=8, description="tokens per example; longer ones are cut on the right "
                                   "(None = no truncation; rows are then not packed unless pack_length is set)")
    train_on_what: TrainOnWhat = "last_assistant_message"
    eval_dataset: str | None = None
    eval_split: str = "train"


class SFTConfig(MeshFields, _Strict):
    base_model: str = Field("tiny", description="HF directory or hub id; 'tiny' = the built-in tiny model")
    runs: list[RunConfig] = Field(default_factory=lambda: [RunConfig()], min_length=1)
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig
    batch_size: int = Field(8, ge=1, description="examples per optimizer step (per run)")
    num_epochs: int | None = Field(1, ge=1)
    num_steps: int | None = Field(None, ge=1, description="overrides num_epochs when set")
    seed: int = Field(0, description="data order")
    pack_length: int | None = Field(None, ge=8, description="tokens per packed row (default: max_length); "
                                    "several examples share a row, attention stays within each")
    packing: bool = True
    micro_batch_tokens: int = Field(DEFAULT_MICRO_BATCH_TOKENS, ge=0, description="padded tokens per jit call: "
                                    "a step's rows are packed by length under this budget (0 = no budget)")
    micro_batch_rows: int = Field(0, ge=0, description="at most this many rows per jit call, over the whole mesh (0 = "
                                  "no row cap)")
    micro_batch_rows_per_device: int | None = Field(
        None, ge=1, description="instead of micro_batch_rows: rows per fsdp device (the seed's "
        "micro_train_batch_size_per_gpu); a jit call takes this x the mesh's fsdp size")
    eval_interval: int = Field(0, ge=0, description="steps between evals (0 = only at the end)")
    eval_before_train: bool = False
    ckpt_path: str | None = Field(None, description="checkpoints go to <ckpt_path>/global_step_N/")
    ckpt_interval: int = Field(0, ge=0, description="steps between checkpoints (0 = only at the end)")
    max_ckpts_to_keep: int = Field(0, ge=0, description="0 = keep all")
    resume_from: str = Field("", description="'' (fresh), 'latest', or a global_step_N directory")
    export_path: str | None = Field(None, description="PEFT adapters per run at the end: <export_path>/<run>/")
    hf_save_interval: int = Field(0, ge=0, description="also export every N steps to <export_path>/global_step_N/<run>/")
    export_merged: bool = Field(False, description="also write base + adapter merged HF models: <export_path>/<run>-merged/")
    cache_dir: str | None = Field(None, description="cache tokenized datasets here (keyed by data, config, tokenizer)")
    force_recache: bool = False
    disable_cache: bool = False
    dummy_run_full_ctx: bool = Field(False, description="train on synthetic full-length rows to check memory")
    dummy_run_max_steps: int = Field(3, ge=1)
    metrics_file: str | None = Field(None, description="JSON lines, one per step and eval")
    wandb_project: str | None = Field(None, description="also log to Weights & Biases (needs the wandb package)")
    wandb_run_name: str | None = Field(None, description="W&B run name (default: wandb's)")
    wandb_tags: list[str] | None = Field(None, description="W&B run tags")
    max_lora_adapters: int | None = Field(None, ge=2, description="default: runs + 1")
    loss_chunk_size: int = Field(1024, ge=1)
    gradient_checkpointing: bool = Field(True, description="recompute each layer in the backward pass")
    remat_policy: Literal["layer", "dots_saveable", "dots_with_no_batch_dims_saveable"] = "layer"
    attention_impl: Literal["auto", "blockwise", "cudnn", "splash", "reference"] = "auto"
    moe_impl: Literal["auto", "ragged_dot", "blocked", "megablox"] = "auto"
    mixed_precision: MixedPrecisionConfig | None = Field(
        None, description="rank-0 (full training) runs only: param_dtype 'bf16' (default; float32 master weights) "
        "or 'fp32'; gradient sums and Adam moments are float32")

    @model_validator(mode="after")
    def _check(self) -> SFTConfig:
        names = [r.name for r in self.runs]
        if len(set(names)) != len(names):
            raise ValueError(f"runs: names must be unique, got {names}")
        if self.num_epochs is None and self.num_steps is None:
            raise ValueError("set num_epochs or num_steps")
        if self.resume_from and not self.ckpt_path and self.resume_from == "latest":
            raise ValueError("resume_from='latest' needs ckpt_path")
        if self.export_merged and not self.export_path:
            raise ValueError("export_merged needs export_path")
        if self.hf_save_interval and not self.export_path:
            raise ValueError("hf_save_interval needs export_path")
        full = [r.name for r in self.runs if r.rank == 0]
        if full and len(self.runs) > 1:
            raise ValueError(f"runs: run(s) {full} have rank 0 (full training), which cannot share a job with other "
                             f"runs ({[r.name for r in self.runs]}): full training owns the base weights; "
                             "train it in a job of its own")
        if self.mixed_precision is not None and not full:
            raise ValueError("mixed_precision applies to full training (a run with rank 0) only: LoRA weights and "
                             "their Adam moments are float32, the base keeps the checkpoint's dtype")
        if self.micro_batch_rows_per_device is not None and "micro_batch_rows" in self.model_fields_set:
            raise ValueError("set micro_batch_rows (per jit call) or micro_batch_rows_per_device (per fsdp device), "
                             "not both")
        if self.export_merged and full:
            raise ValueError("export_merged: a rank-0 run's export (export_path) already is the whole model")
        if self.dummy_run_full_ctx and self.data.max_length is None:
            raise ValueError("dummy_run_full_ctx needs data.max_length (the length of the synthetic rows)")
        if self.pack_length is not None and self.data.max_length is not None and self.pack_length < self.data.max_length:
            raise ValueError(f"pack_length={self.pack_length} is smaller than data.max_length={self.data.max_length}")
        return self

    @property
    def training_mode(self) -> Literal["lora", "full"]:
        """'full' when the (single) run has rank 0: the base weights themselves are trained."""
        return "full" if self.runs[0].rank == 0 else "lora"
