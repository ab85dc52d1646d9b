"""SkyRL's SFTConfig names, read into tx's SFTConfig.

A config written for SkyRL's SFT trainer (`model.path`, `model.lora.rank`, `optimizer_config.lr`,
`dataset_name`, `micro_train_batch_size_per_gpu`, ...) is validated against the seed's field names and
defaults (unknown keys are errors that name the key), then translated to tx's own config. Fields that only
mean something to Ray / Megatron / PyTorch-FSDP placement are refused, naming the field and the reason (as
tx.rl does: a config that sets them expects an effect tx cannot give); fields tx cannot honour with the value
given are errors. A `tx:` section holds tx-only
settings (native SFTConfig names, merged last).

The single run is named "policy", so checkpoints and exports land where SkyRL puts them
(`<ckpt_path>/global_step_N/policy`, `<export_path>/global_step_N/policy`). `model.lora.rank: 0` (the seed's
default) means full training.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from tx.sft.config import SFTConfig
from tx.training.overrides import deep_merge
# the sections tx.rl's config shares; tx.sft.seed_config.OptimizerConfig etc. stay importable
from tx.training.seed_config import OptimizerConfig, SeedModel, SkyRLLoraConfig, lora_targets


class SeedFieldIgnored(UserWarning):
    """A seed config value tx reads differently from SkyRL (e.g. resume_from='latest' without a ckpt_path)."""


class ModelConfig(SeedModel):
    path: str | None = "Qwen/Qwen3-0.6B"
    lora: SkyRLLoraConfig = SkyRLLoraConfig()


class SFTPlacementConfig(SeedModel):
    num_nodes: int = 1
    num_gpus_per_node: int = 4


class MixedPrecisionConfig(SeedModel):
    param_dtype: str = "bf16"
    reduce_dtype: str = "fp32"
    buffer_dtype: str = "fp32"


class FSDPConfig(SeedModel):
    cpu_offload: bool = False
    reshard_after_forward: bool | int = True
    fsdp_size: int = -1
    mixed_precision: MixedPrecisionConfig | None = None
    wrap_policy: dict[str, Any] = {}


def _default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tx", "tokenized_datasets")


class SeedSFTConfig(SeedModel):
    """SkyRL's SFTConfig fields with SkyRL's defaults."""

    model: ModelConfig = ModelConfig()
    optimizer_config: OptimizerConfig = OptimizerConfig()
    placement: SFTPlacementConfig = SFTPlacementConfig()
    megatron_config: dict[str, Any] = {}  # every MegatronConfig knob is placement: accepted, ignored
    fsdp_config: FSDPConfig = FSDPConfig()
    sequence_parallel_size: int = Field(1, ge=1)
    model_config_kwargs: dict[str, Any] = {}
    use_torch_compile: bool = False
    record_memory: bool = False
    strategy: Literal["megatron", "fsdp", "fsdp2"] = "megatron"
    dataset_name: str = "yahma/alpaca-cleaned"
    dataset_split: str = "train[:100]"
    messages_key: str = "messages"
    tools_key: str = "tools"
    system_key: str = "system"
    eval_dataset_name: str | None = None
    eval_dataset_split: str = "validation"
    eval_interval: int = 0
    eval_before_train: bool = False
    max_length: int | None = Field(None, ge=8)
    num_steps: int | None = Field(None, ge=1)
    num_epochs: int | None = Field(1, ge=1)
    batch_size: int = Field(4, ge=1)
    micro_train_batch_size_per_gpu: int = Field(2, ge=1)
    logger: str | list[str] = "console"
    project_name: str = "skyrl_sft"
    run_name: str = "skyrl_sft_run"
    tags: list[str] | None = None
    ckpt_path: str = ""
    ckpt_interval: int = 0
    enable_ray_gpu_monitor: bool = True
    max_ckpts_to_keep: int = -1
    resume_from: str = ""
    hf_save_interval: int = 0
    export_path: str = ""
    seed: int = 42
    num_workers: int = Field(8, ge=0)
    cache_dir: str = Field(default_factory=_default_cache_dir)
    force_recache: bool = False
    disable_cache: bool = False
    train_on_what: Literal["last_assistant_message", "all_assistant_messages", "all"] = "last_assistant_message"
    remove_microbatch_padding: bool = True
    use_sample_packing: bool | None = Field(None, description="deprecated alias of remove_microbatch_padding")
    use_sequence_packing: bool = False
    max_tokens_per_microbatch: int | None = Field(None, ge=8)
    dummy_run_full_ctx: bool = False
    dummy_run_max_steps: int = Field(5, ge=1)
    tx: dict[str, Any] = Field({}, description="tx-only settings, native SFTConfig names, merged last")

    @field_validator("train_on_what", mode="before")
    @classmethod
    def _enum_name(cls, v: Any) -> Any:  # TrainOnWhat.LAST_ASSISTANT_MESSAGE, as OmegaConf may write it
        return v.split(".")[-1].lower() if isinstance(v, str) else v


# seed field -> why tx refuses it (placement / PyTorch-engine only)
NOT_APPLICABLE = {
    "placement": "Ray placement: tx is one SPMD program over every device JAX sees",
    "megatron_config": "Megatron parallelism: tx shards over its own (fsdp, ep, tp) mesh",
    "fsdp_config": "PyTorch FSDP wrapping: tx shards over its own (fsdp, ep, tp) mesh; LoRA weights and their "
                   "Adam moments are float32, the base runs in the checkpoint's dtype",
    "sequence_parallel_size": "Ulysses sequence parallelism: tx fits long rows with remat and token-budgeted "
                              "micro-batches instead",
    "strategy": "chooses the PyTorch engine (megatron / fsdp); tx has one JAX engine",
    "use_torch_compile": "tx is always jit-compiled",
    "record_memory": "CUDA memory snapshots",
    "enable_ray_gpu_monitor": "Ray GPU monitor",
    "num_workers": "tokenization worker processes; tx tokenizes in-process (same examples)",
    "remove_microbatch_padding": "PyTorch THD layout; tx packs rows by length itself",
    "use_sample_packing": "deprecated alias of remove_microbatch_padding (PyTorch THD layout)",
    "optimizer_config.offload_after_step": "optimizer CPU offload between colocated Ray workers",
    "model.lora.lora_sync_path": "weight sync to vLLM; tx samples the arrays it trains",
}
def _set_paths(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields the user wrote (not defaults), recursing into nested models and dicts."""
    out = []
    for name in sorted(model.model_fields_set):
        value = getattr(model, name)
        if isinstance(value, BaseModel) and value.model_fields_set:
            out += _set_paths(value, f"{prefix}{name}.")
        elif isinstance(value, dict) and value and name != "tx":
            out += [f"{prefix}{name}.{k}" for k in value]
        else:
            out.append(f"{prefix}{name}")
    return out


def _not_applicable_reason(path: str, full: bool) -> str | None:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix == "fsdp_config.mixed_precision":  # the precision policy of full training (rank 0)
            return None if full else ("applies to full training (rank 0) only: LoRA weights and their Adam "
                                      "moments are float32, the base keeps the checkpoint's dtype")
        reason = NOT_APPLICABLE.get(prefix)
        if reason:
            return reason
    return None


def _check_honourable(s: SeedSFTConfig) -> None:
    """Fields tx cannot honour with the given value: errors, never silent drops."""
    lora = s.model.lora
    if s.model.path is None:
        raise ValueError("model.path: required (an HF directory or hub id, or 'tiny')")
    if lora.dropout:
        raise ValueError(f"model.lora.dropout = {lora.dropout}: tx's LoRA has no dropout; set 0.0")
    if lora.init_method != "kaiming":
        raise ValueError(f"model.lora.init_method = {lora.init_method!r}: tx initializes LoRA as PEFT does "
                         "(kaiming-uniform A, zero B); only 'kaiming' is supported")
    if s.model_config_kwargs:
        raise ValueError(f"model_config_kwargs = {s.model_config_kwargs}: tx reads the model config from the "
                         "checkpoint and cannot override it")
    loggers = [s.logger] if isinstance(s.logger, str) else s.logger
    bad = [x for x in loggers if x not in ("console", "wandb")]
    if bad:
        raise ValueError(f"logger: {bad} not supported by tx.sft (console, wandb)")
    if s.use_sequence_packing and s.max_length is None:
        raise ValueError("use_sequence_packing=True needs max_length (the bin capacity defaults to it)")
    if s.use_sample_packing is not None and "remove_microbatch_padding" in s.model_fields_set:
        raise ValueError("Specify only one of use_sample_packing (deprecated) and remove_microbatch_padding, not both.")


def translate(s: SeedSFTConfig) -> dict[str, Any]:
    """The native SFTConfig values a validated seed config means (refuses the placement-only fields it sets)."""
    _check_honourable(s)
    for path in _set_paths(s):
        reason = _not_applicable_reason(path, full=s.model.lora.rank == 0)
        if reason:
            raise ValueError(f"{path}: not applicable to tx ({reason}); remove it")
    lora, opt = s.model.lora, s.optimizer_config
    run = {"name": "policy", "rank": lora.rank, "alpha": lora.alpha, "seed": s.seed, "learning_rate": opt.lr,
           "weight_decay": opt.weight_decay}
    if lora.rank:  # rank 0 trains every weight: the LoRA targets mean nothing there (as in SkyRL)
        run |= lora_targets(lora.target_modules, lora.exclude_modules)
    ckpt_path = s.ckpt_path or None
    export_path = s.export_path or None
    if export_path is None and s.hf_save_interval > 0:
        if ckpt_path is None:
            raise ValueError("hf_save_interval > 0 needs export_path or ckpt_path (exports default to "
                             "<ckpt_path>/hf_exports)")
        export_path = os.path.join(ckpt_path, "hf_exports")
    resume_from = s.resume_from
    if resume_from == "latest" and ckpt_path is None:
        warnings.warn("resume_from: 'latest' with an empty ckpt_path starts fresh (as in SkyRL)", SeedFieldIgnored,
                      stacklevel=3)
        resume_from = ""
    loggers = [s.logger] if isinstance(s.logger, str) else s.logger
    wandb = "wandb" in loggers
    native = {
        "base_model": s.model.path,
        "runs": [run],
        "optimizer": {"beta1": opt.adam_betas[0], "beta2": opt.adam_betas[1], "grad_clip_norm": opt.max_grad_norm,
                      "scheduler": opt.scheduler, "warmup_steps": opt.num_warmup_steps},
        "data": {"dataset": s.dataset_name, "split": s.dataset_split, "messages_key": s.messages_key,
                 "tools_key": s.tools_key, "system_key": s.system_key, "max_length": s.max_length,
                 "train_on_what": s.train_on_what, "eval_dataset": s.eval_dataset_name,
                 "eval_split": s.eval_dataset_split},
        "batch_size": s.batch_size,
        "num_epochs": s.num_epochs,
        "num_steps": s.num_steps,
        "seed": s.seed,
        "packing": s.use_sequence_packing,
        "pack_length": s.max_tokens_per_microbatch,
        "micro_batch_rows_per_device": s.micro_train_batch_size_per_gpu,
        "eval_interval": max(0, s.eval_interval),  # SkyRL: <= 0 disables periodic eval
        "eval_before_train": s.eval_before_train,
        "ckpt_path": ckpt_path,
        "ckpt_interval": max(0, s.ckpt_interval),  # SkyRL: <= 0 -> no periodic checkpoints
        "max_ckpts_to_keep": max(0, s.max_ckpts_to_keep),  # SkyRL -1 (keep all) is tx's 0
        "resume_from": resume_from,
        "export_path": export_path,
        "hf_save_interval": max(0, s.hf_save_interval),
        "cache_dir": s.cache_dir,
        "force_recache": s.force_recache,
        "disable_cache": s.disable_cache,
        "dummy_run_full_ctx": s.dummy_run_full_ctx,
        "dummy_run_max_steps": s.dummy_run_max_steps,
        "wandb_project": s.project_name if wandb else None,
        "wandb_run_name": s.run_name if wandb else None,
        "wandb_tags": s.tags if wandb else None,
    }
    precision = s.fsdp_config.mixed_precision
    if lora.rank == 0 and precision is not None:
        native["mixed_precision"] = precision.model_dump()
    return deep_merge(native, s.tx)


def from_seed(values: dict[str, Any], override_keys: set[str] = frozenset()) -> SFTConfig:
    """tx's SFTConfig for a config written with SkyRL's SFTConfig names (nested dicts).

    `override_keys`: the top-level keys given as command-line overrides; as in SkyRL's `from_cli_overrides`,
    num_epochs and num_steps may not both be among them.
    """
    if {"num_epochs", "num_steps"} <= set(override_keys):
        raise ValueError("Cannot specify both num_epochs and num_steps")
    return SFTConfig.model_validate(translate(SeedSFTConfig.model_validate(values)))


SEED_ONLY = frozenset(SeedSFTConfig.model_fields) - frozenset(SFTConfig.model_fields)
NATIVE_ONLY = frozenset(SFTConfig.model_fields) - frozenset(SeedSFTConfig.model_fields)


def detect_format(values: dict[str, Any]) -> Literal["tx", "seed"]:
    """'seed' if a top-level key exists only in SkyRL's SFTConfig, 'tx' otherwise (shared keys are both)."""
    seed, native = sorted(SEED_ONLY & set(values)), sorted(NATIVE_ONLY & set(values))
    if seed and native:
        raise ValueError(f"config mixes SkyRL SFTConfig keys {seed} with tx SFTConfig keys {native}; write one "
                         "format (tx-only settings go under 'tx:' in a SkyRL-format config)")
    return "seed" if seed else "tx"
