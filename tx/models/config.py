"""Model configuration: the architecture fields tx reads from an HF `config.json`, plus LoRA slot sizes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DType = Literal["float32", "bfloat16", "float16"]


class Llama3Rope(BaseModel):
    """Llama 3.1's RoPE frequency scaling (`rope_type: llama3`): long wavelengths divided by `factor`, short ones
    kept, a smooth blend between `low_freq_factor` and `high_freq_factor` of the original context."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)


class YarnRope(BaseModel):
    """YaRN RoPE scaling (`rope_type: yarn`; DeepSeek-V3, Kimi-K2, long-context Qwen3), transformers' fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def key(self) -> tuple:
        """The tuple `tx.models.layers.rope.yarn_inv_freq` takes."""
        return (self.factor, self.original_max_position_embeddings, self.beta_fast, self.beta_slow, self.mscale,
                self.mscale_all_dim, self.attention_factor, self.truncate)


class MLA(BaseModel):
    """DeepSeek-V2/V3's multi-head latent attention: queries through an optional low-rank `q_lora_rank`
    bottleneck, keys and values from one `kv_lora_rank` latent per token (plus a shared RoPE key of
    `qk_rope_head_dim`), each head's query/key = a `qk_nope_head_dim` part without RoPE and the RoPE part."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    q_lora_rank: int | None = Field(None, gt=0, description="None: one q_proj; else q_a_proj -> norm -> q_b_proj")
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    rope_interleave: bool = Field(True, description="the RoPE dims are stored interleaved (HF DeepseekV3's default)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class ModelConfig(BaseModel):
    """Architecture of a Qwen3 / Qwen3-MoE / Llama 3 / DeepSeek-V3 model, validated from an HF config dict."""

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
    llama3_rope: Llama3Rope | None = Field(None, description="Llama 3.1 RoPE scaling (rope_type llama3); None: default RoPE")
    yarn_rope: YarnRope | None = Field(None, description="YaRN RoPE scaling (rope_type yarn)")
    qk_norm: bool = Field(True, description="per-head RMSNorm of queries and keys before RoPE (Qwen3; Llama has none)")
    max_position_embeddings: int = Field(gt=0)
    tie_word_embeddings: bool = False
    dtype: DType = Field("float32", description="dtype of the base weights")
    # MoE fields; num_experts == 0 means a dense model.
    num_experts: int = Field(0, ge=0)
    num_experts_per_tok: int = Field(0, ge=0)
    moe_intermediate_size: int = Field(0, ge=0)
    norm_topk_prob: bool = False
    decoder_sparse_step: int = Field(1, gt=0)
    mlp_only_layers: tuple[int, ...] = ()
    # DeepSeek-V3: latent attention, sigmoid routing over expert groups, shared experts, dense first layers
    mla: MLA | None = Field(None, description="multi-head latent attention (DeepSeek-V3); None: grouped-query")
    moe_router: Literal["softmax", "sigmoid_grouped"] = Field(
        "softmax", description="softmax top-k (Qwen3-MoE) or DeepSeek-V3's sigmoid scores with a selection bias, "
                               "top-k within the best `topk_group` of `n_group` expert groups")
    n_group: int = Field(1, gt=0)
    topk_group: int = Field(1, gt=0)
    routed_scaling_factor: float = Field(1.0, gt=0)
    n_shared_experts: int = Field(0, ge=0, description="experts every token goes through (one MLP of that many "
                                                        "times moe_intermediate_size)")
    first_k_dense_replace: int = Field(0, ge=0, description="the first layers keep a dense MLP")

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
            if self.num_experts % self.n_group or not self.topk_group <= self.n_group:
                raise ValueError(f"n_group={self.n_group} must divide num_experts={self.num_experts} and be >= "
                                 f"topk_group={self.topk_group}")
            if self.moe_router == "sigmoid_grouped" and self.num_experts // self.n_group < 2:
                raise ValueError(f"sigmoid_grouped routing scores each group by its best two experts: "
                                 f"num_experts={self.num_experts} / n_group={self.n_group} is below 2")
        if self.mla is not None and self.head_dim != self.mla.qk_rope_head_dim:
            raise ValueError(f"head_dim={self.head_dim} must equal mla.qk_rope_head_dim={self.mla.qk_rope_head_dim} "
                             f"(RoPE covers the rope part of each head)")
        return self

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen3-MoE's rule (sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid) after
        DeepSeek-V3's first_k_dense_replace dense layers."""
        return (
            self.num_experts > 0
            and layer >= self.first_k_dense_replace
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read an HF config dict as transformers 4.x or 5.x writes it, with transformers' own defaults."""
        hf = dict(hf.get("text_config") or hf) if "text_config" in hf else dict(hf)
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model family")
        family = _family(hf.get("model_type"), archs[0])
        _refuse_unsupported(hf)

        def get(key: str) -> Any:
            value = hf.get(key)
            return family.defaults.get(key) if value is None else value

        heads = get("num_attention_heads")
        num_experts = _num_experts(hf, family)
        if family.moe and not num_experts:
            raise ValueError(f"model_type {hf.get('model_type')!r} ({archs[0]}) needs experts, but num_experts / "
                             f"num_local_experts is {num_experts}")
        if not family.moe and num_experts:
            raise ValueError(f"model_type {hf.get('model_type')!r} ({archs[0]}) is dense, but config.json gives "
                             f"{num_experts} experts")
        mla = _mla(hf, family)
        head_dim = hf.get("head_dim")
        if mla is not None:  # DeepseekV3Config sets head_dim = qk_rope_head_dim (what RoPE covers)
            head_dim = mla.qk_rope_head_dim
        elif head_dim is None:  # Qwen3Config has a field (default 128); Qwen3-MoE derives it
            head_dim = family.defaults.get("head_dim") or get("hidden_size") // heads
        deepseek = {}
        if family.architecture == "DeepseekV3ForCausalLM":
            deepseek = dict(mla=mla, moe_router="sigmoid_grouped", n_group=get("n_group"),
                            topk_group=get("topk_group"), routed_scaling_factor=get("routed_scaling_factor"),
                            n_shared_experts=get("n_shared_experts"), first_k_dense_replace=get("first_k_dense_replace"))
        return cls(
            architecture=archs[0],
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_hidden_layers=get("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=_kv_heads(hf, family, heads),
            head_dim=head_dim,
            rms_norm_eps=get("rms_norm_eps"),
            rope_theta=_rope_theta(hf),
            llama3_rope=_llama3_rope(hf),
            yarn_rope=_yarn_rope(hf, get("max_position_embeddings")),
            qk_norm=family.qk_norm,
            max_position_embeddings=get("max_position_embeddings"),
            tie_word_embeddings=get("tie_word_embeddings"),
            dtype=hf.get("dtype") or hf.get("torch_dtype") or "float32",
            num_experts=num_experts,
            num_experts_per_tok=get("num_experts_per_tok") if num_experts else 0,
            moe_intermediate_size=get("moe_intermediate_size") if num_experts else 0,
            norm_topk_prob=get("norm_topk_prob") if num_experts else False,
            decoder_sparse_step=get("decoder_sparse_step") if num_experts else 1,
            mlp_only_layers=tuple(get("mlp_only_layers") or ()),
            **deepseek,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        return cls.from_hf_dict(json.loads(cfg_path.read_text()))



@dataclass(frozen=True)
class _Family:
    """One HF model_type: its architecture name and the defaults of transformers' config class."""

    architecture: str
    moe: bool
    defaults: dict[str, Any]
    qk_norm: bool = True


_COMMON = {"vocab_size": 151936, "num_attention_heads": 32, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": False}
# Defaults of transformers' Qwen3Config / Qwen3MoeConfig (same in 4.5x and 5.x): keys missing from a
# config.json mean these values to transformers, so they must mean the same to tx.
_FAMILIES = {
    "qwen3": _Family("Qwen3ForCausalLM", False, {
        **_COMMON, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32, "head_dim": 128,
        "num_key_value_heads": 32}),
    "qwen3_moe": _Family("Qwen3MoeForCausalLM", True, {
        **_COMMON, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24, "num_key_value_heads": 4,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
        "decoder_sparse_step": 1, "mlp_only_layers": []}),
    # transformers' LlamaConfig: no head_dim default (hidden_size // heads), null kv heads = as many as heads
    "llama": _Family("LlamaForCausalLM", False, {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False}, qk_norm=False),
    # transformers' DeepseekV3Config (the DeepSeek-V3 / Kimi-K2 architecture)
    "deepseek_v3": _Family("DeepseekV3ForCausalLM", True, {
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": None, "n_shared_experts": 1,
        "num_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_interleave": True, "decoder_sparse_step": 1},
        qk_norm=False),
}
DEFAULT_ROPE_THETA = 10_000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


def _family(model_type: str | None, architecture: str) -> _Family:
    """The family named by model_type (or, without one, by the architecture); the two must agree."""
    if model_type is None:
        by_arch = [f for f in _FAMILIES.values() if f.architecture == architecture]
        if not by_arch:  # let the model registry name the supported architectures
            return _Family(architecture, False, _COMMON)
        return by_arch[0]
    family = _FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(_FAMILIES))}")
    if family.architecture != architecture:
        raise ValueError(f"config.json says model_type {model_type!r} but architectures[0] {architecture!r}; "
                         f"{model_type!r} is {family.architecture}")
    return family


def _num_experts(hf: dict[str, Any], family: _Family) -> int:
    """transformers 4.x writes num_experts, 5.x num_local_experts (an attribute_map alias), DeepSeek
    n_routed_experts."""
    given = {k: hf[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if hf.get(k) is not None}
    if len(set(given.values())) > 1:
        raise ValueError(f"config.json gives different expert counts: {given}")
    if given:
        return int(next(iter(given.values())))
    return family.defaults.get("num_experts", 0)


def _mla(hf: dict[str, Any], family: _Family) -> MLA | None:
    """DeepSeek-V3's latent-attention sizes (a missing key takes the class default; q_lora_rank null: q_proj)."""
    if family.architecture != "DeepseekV3ForCausalLM":
        return None
    sizes = {k: hf[k] if k in hf else family.defaults[k]
             for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                       "rope_interleave")}
    return MLA(**sizes)


def _kv_heads(hf: dict[str, Any], family: _Family, heads: int) -> int:
    """A missing key takes the class default; an explicit null means "as many as attention heads"."""
    kv = hf["num_key_value_heads"] if "num_key_value_heads" in hf else family.defaults.get("num_key_value_heads")
    return heads if kv is None else kv


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 reads rope_scaling, else rope_parameters (its own spelling)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"rope_parameters {rope!r}: per-layer-type RoPE is not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "yarn"):
        raise ValueError(f"rope_type={rope_type!r} is not supported (default, llama3 and yarn RoPE only)")
    return rope | {"rope_type": rope_type}


def _rope_theta(hf: dict[str, Any]) -> float:
    """rope_theta inside the RoPE parameters wins over the 4.x top-level key, else the default."""
    theta = _rope_parameters(hf).get("rope_theta", hf.get("rope_theta"))
    return DEFAULT_ROPE_THETA if theta is None else theta


def _llama3_rope(hf: dict[str, Any]) -> Llama3Rope | None:
    rope = _rope_parameters(hf)
    if rope["rope_type"] != "llama3":
        return None
    missing = [k for k in Llama3Rope.model_fields if rope.get(k) is None]
    if missing:
        raise ValueError(f"rope_type='llama3' needs {', '.join(missing)} in rope_scaling / rope_parameters")
    return Llama3Rope(**{k: rope[k] for k in Llama3Rope.model_fields})


def _yarn_rope(hf: dict[str, Any], max_position_embeddings: int) -> YarnRope | None:
    rope = _rope_parameters(hf)
    if rope["rope_type"] != "yarn":
        return None
    if rope.get("original_max_position_embeddings") is None:
        raise ValueError("rope_type='yarn' needs original_max_position_embeddings in rope_scaling / rope_parameters")
    fields = {k: rope[k] for k in YarnRope.model_fields if rope.get(k) is not None}
    # transformers: without a factor, the ratio of the context to the original one
    fields.setdefault("factor", max_position_embeddings / rope["original_max_position_embeddings"])
    return YarnRope(**fields)


def _refuse_unsupported(hf: dict[str, Any]) -> None:
    """Features transformers' Qwen3 has and tx does not: loading them would compute something else."""
    if hf.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported (Qwen3 and Llama 3 checkpoints have no attention biases)")
    if hf.get("quantization_config"):
        raise ValueError(f"quantized checkpoints are not supported (quantization_config "
                         f"{hf['quantization_config'].get('quant_method', '?')!r}); convert the weights to "
                         f"bfloat16 first")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported (Llama 3 checkpoints have no MLP biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (silu only)")
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported (full attention only)")
    other = sorted({t for t in hf.get("layer_types") or () if t != "full_attention"})
    if other:
        raise ValueError(f"layer_types {other} are not supported (full_attention only)")


class LoraSlots(BaseModel):
    """How many adapters the model holds at once and the largest rank any of them may use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_lora_adapters: int = Field(
        16, ge=1, description="adapter slots A, including slot 0 which is the base model (zero delta)"
    )
    max_lora_rank: int = Field(32, ge=1, description="rank R every LoRA weight is allocated with")
