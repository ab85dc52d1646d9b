"""The seed config sections both trainers read (SkyRL's names and defaults): the LoRA section
(`model.lora.*`), the optimizer section (`optimizer_config.*`), and the translation of PEFT-style LoRA target
names to tx's layer groups. `SeedModel` is their base: unknown keys are errors naming the key.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SeedModel(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())  # SkyRL has a field model_config_kwargs


class SkyRLLoraConfig(SeedModel):
    rank: int = Field(0, ge=0, description="LoRA rank; 0 = full training")
    alpha: float = Field(16, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    lora_sync_path: str = "/tmp/skyrl_lora_sync"
    target_modules: str | list[str] = "all-linear"
    exclude_modules: str | list[str] | None = None
    init_method: str = "kaiming"


class OptimizerConfig(SeedModel):
    lr: float = Field(1e-6, ge=0)
    adam_betas: list[float] = Field([0.9, 0.999], min_length=2, max_length=2)
    weight_decay: float = Field(0.01, ge=0)
    max_grad_norm: float = Field(1.0, ge=0)
    offload_after_step: bool = True
    num_warmup_steps: int = Field(0, ge=0)
    scheduler: Literal["constant_with_warmup", "cosine", "linear"] = "constant_with_warmup"

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, v: list[float]) -> list[float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {v}")
        return v


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)


def _module_names(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    names = value.split(",") if isinstance(value, str) else value
    return [n.strip() for n in names if n.strip()]


def lora_targets(target_modules: str | list[str], exclude_modules: str | list[str] | None) -> dict[str, bool]:
    """PEFT-style target names -> tx's train_attn / train_mlp / train_unembed (whole groups only)."""
    names = _module_names(target_modules)
    # PEFT's "all-linear" is every linear layer except the output layer
    chosen = set(ATTN + MLP) if names == ["all-linear"] else set(names)
    unknown = sorted(chosen - set(ATTN + MLP + UNEMBED))
    if unknown:
        raise ValueError(f"model.lora.target_modules: {unknown} are not module names tx can adapt; use 'all-linear' "
                         f"or whole groups of {list(ATTN)}, {list(MLP)}, {list(UNEMBED)}")
    excluded = set(_module_names(exclude_modules))
    if excluded - set(ATTN + MLP + UNEMBED):
        raise ValueError(f"model.lora.exclude_modules: {sorted(excluded - set(ATTN + MLP + UNEMBED))} are not module "
                         "names tx knows")
    chosen -= excluded
    flags = {}
    for flag, group in (("train_attn", ATTN), ("train_mlp", MLP), ("train_unembed", UNEMBED)):
        picked = chosen & set(group)
        if picked and picked != set(group):
            raise ValueError(f"model.lora target_modules={target_modules!r} exclude_modules={exclude_modules!r} adapt "
                             f"only {sorted(picked)} of {list(group)}: tx adapts these layers as one group")
        flags[flag] = bool(picked)
    if not any(flags.values()):
        raise ValueError(f"model.lora: target_modules={target_modules!r} minus exclude_modules={exclude_modules!r} "
                         "leaves no layer to adapt")
    return flags
