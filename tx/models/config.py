"""Model configuration: the architecture fields tx reads from an HF `config.json`, plus LoRA slot sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DType = Literal["float32", "bfloat16", "float16"]


class ModelConfig(BaseModel):
    """Architecture of a Qwen3 / Qwen3-MoE model, validated from an HF config dict."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: str = Field(description="HF `architectures[0]`, e.g. Qwen3ForCausalLM; picks the model family")
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0, description="dense MLP width")
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    tie_word_embeddings: bool = False
    dtype: DType = Field("float32", description="dtype of the base weights")
    # MoE fields; num_experts == 0 means a dense model.
    num_experts: int = Field(0, ge=0)
    num_experts_per_tok: int = Field(0, ge=0)
    moe_intermediate_size: int = Field(0, ge=0)
    norm_topk_prob: bool = True
    decoder_sparse_step: int = Field(1, gt=0)
    mlp_only_layers: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError("moe_intermediate_size must be > 0 for an MoE model")
        return self

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen3-MoE's rule: sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read the fields tx needs from an HF config dict; unsupported features raise a clear error."""
        hf = dict(hf.get("text_config") or hf) if "text_config" in hf else dict(hf)
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model family")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope_type={rope_type!r} is not supported (only default RoPE)")
        rope_theta = hf.get("rope_theta", rope.get("rope_theta"))
        if rope_theta is None:
            raise ValueError("config.json has no rope_theta (top level or in rope_parameters)")
        heads = hf["num_attention_heads"]
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        num_experts = hf.get("num_experts", 0) or 0
        return cls(
            architecture=archs[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            dtype=dtype,
            num_experts=num_experts,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=hf.get("moe_intermediate_size", 0) if num_experts else 0,
            norm_topk_prob=hf.get("norm_topk_prob", True),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        return cls.from_hf_dict(json.loads(cfg_path.read_text()))


class LoraSlots(BaseModel):
    """How many adapters the model holds at once and the largest rank any of them may use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_lora_adapters: int = Field(
        16, ge=1, description="adapter slots A, including slot 0 which is the base model (zero delta)"
    )
    max_lora_rank: int = Field(32, ge=1, description="rank R every LoRA weight is allocated with")
