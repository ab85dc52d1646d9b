"""Write a random Qwen3 / Qwen3-MoE / Llama 3 / DeepSeek-V3 checkpoint in HF format, offline.

    python -m tx.models.tiny OUT_DIR [--moe] [--family llama|deepseek_v3] [--hidden-size 64] [--num-layers 2] ...

The directory holds `config.json`, `model.safetensors` (or several shards with
`model.safetensors.index.json`), `generation_config.json` and a small BPE tokenizer with Qwen's special
tokens and a chat template, so transformers, tx and the tinker SDK's tokenizer code all load it.
Tensor names and layouts are those of the released Qwen3 checkpoints (per-expert MoE weights); `family="llama"`
writes a `LlamaForCausalLM` (no q/k norms; with `llama3_rope`, Llama 3.1's `rope_scaling`); `family="deepseek_v3"` a
`DeepseekV3ForCausalLM` (latent attention, `first_k_dense_replace` dense layers, then routed experts in groups with
a selection bias beside shared experts; per-expert tensors as DeepSeek's released checkpoints).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Literal

import ml_dtypes
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tx.models.safetensors_io import SafetensorsDir, save_file
from tx.models.tiny_tokenizer import SPECIAL_TOKENS, build_tokenizer


class TinySpec(BaseModel):
    """Shape of the random model; defaults make a ~0.1M-parameter model that runs anywhere in milliseconds."""

    model_config = ConfigDict(extra="forbid")

    family: Literal["qwen3", "llama", "deepseek_v3"] = Field(
        "qwen3", description="qwen3 (dense or --moe), llama (Llama 3, dense) or deepseek_v3 (MLA + MoE)")
    llama3_rope: bool = Field(False, description="llama: Llama 3.1's rope_scaling (factor 8, original context 8192)")
    vocab_size: int = Field(512, ge=len(SPECIAL_TOKENS) + 256, description="model vocab (>= tokenizer size)")
    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    head_dim: int = Field(16, gt=0)
    tie_word_embeddings: bool = False
    moe: bool = False
    num_experts: int = Field(8, gt=0)
    num_experts_per_tok: int = Field(2, gt=0)
    moe_intermediate_size: int = Field(32, gt=0)
    norm_topk_prob: bool = True
    decoder_sparse_step: int = Field(1, gt=0)
    mlp_only_layers: list[int] = []
    # deepseek_v3: latent attention (qk_nope_head_dim = v_head_dim = head_dim) and its routing
    q_lora_rank: int = Field(32, ge=0, description="deepseek_v3: the query bottleneck's rank (0: one q_proj)")
    kv_lora_rank: int = Field(32, gt=0, description="deepseek_v3: the cached latent's size")
    qk_rope_head_dim: int = Field(8, gt=0, description="deepseek_v3: the RoPE part of each query/key head")
    n_shared_experts: int = Field(1, ge=0)
    n_group: int = Field(2, gt=0)
    topk_group: int = Field(1, gt=0)
    routed_scaling_factor: float = Field(2.5, gt=0)
    first_k_dense_replace: int = Field(1, ge=0)
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096
    dtype: Literal["float32", "bfloat16"] = "float32"
    init_std: float = Field(0.1, gt=0, description="std of random weights; larger gives peakier logits")
    seed: int = 0
    shards: int = Field(1, ge=1, description="number of safetensors files (>1 writes an index)")

    @model_validator(mode="after")
    def _family_fields(self):
        if self.family == "llama" and self.moe:
            raise ValueError("moe=True needs family='qwen3' (Llama 3 is dense)")
        if self.family == "deepseek_v3" and self.moe:
            raise ValueError("family='deepseek_v3' is always MoE (after first_k_dense_replace dense layers): drop moe")
        if self.llama3_rope and self.family != "llama":
            raise ValueError(f"llama3_rope=True needs family='llama' (family={self.family!r})")
        return self

# Llama 3.1's RoPE scaling (its released config.json)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _deepseek_config(spec: TinySpec) -> dict:
    """DeepseekV3Config's fields (every key written: none falls back to DeepSeek-V3's own sizes)."""
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_key_value_heads": spec.num_heads,
            "q_lora_rank": spec.q_lora_rank or None, "kv_lora_rank": spec.kv_lora_rank,
            "qk_nope_head_dim": spec.head_dim, "qk_rope_head_dim": spec.qk_rope_head_dim, "v_head_dim": spec.head_dim,
            "head_dim": spec.qk_rope_head_dim, "n_routed_experts": spec.num_experts,
            "num_experts_per_tok": spec.num_experts_per_tok, "moe_intermediate_size": spec.moe_intermediate_size,
            "n_shared_experts": spec.n_shared_experts, "n_group": spec.n_group, "topk_group": spec.topk_group,
            "routed_scaling_factor": spec.routed_scaling_factor, "first_k_dense_replace": spec.first_k_dense_replace,
            "norm_topk_prob": spec.norm_topk_prob, "rope_interleave": True}


def hf_config(spec: TinySpec) -> dict:
    arch, model_type = ("Qwen3MoeForCausalLM", "qwen3_moe") if spec.moe else ("Qwen3ForCausalLM", "qwen3")
    if spec.family == "llama":
        arch, model_type = "LlamaForCausalLM", "llama"
    cfg = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"),
        "pad_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "dtype": spec.dtype,
        "use_cache": True,
    }
    if spec.family == "deepseek_v3":
        cfg |= _deepseek_config(spec)
    if spec.family == "llama":
        cfg |= {"mlp_bias": False, "pretraining_tp": 1, "rope_scaling": LLAMA31_ROPE if spec.llama3_rope else None}
    if spec.moe:
        cfg |= {
            "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.num_experts_per_tok,
            "moe_intermediate_size": spec.moe_intermediate_size,
            "norm_topk_prob": spec.norm_topk_prob,
            "decoder_sparse_step": spec.decoder_sparse_step,
            "mlp_only_layers": spec.mlp_only_layers,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
        }
    return cfg


def random_weights(spec: TinySpec) -> dict[str, np.ndarray]:
    """HF-named tensors in HF layout ([out, in] linears)."""
    rng = np.random.default_rng(spec.seed)
    d, hd = spec.hidden_size, spec.head_dim

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * spec.init_std).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    out = {"model.embed_tokens.weight": w(spec.vocab_size, d), "model.norm.weight": norm(d)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = w(spec.vocab_size, d)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d)}
        if spec.family == "deepseek_v3":
            out |= _latent_attention(spec, p, w, norm)
        else:
            out |= {
                p + "self_attn.q_proj.weight": w(spec.num_heads * hd, d),
                p + "self_attn.k_proj.weight": w(spec.num_kv_heads * hd, d),
                p + "self_attn.v_proj.weight": w(spec.num_kv_heads * hd, d),
                p + "self_attn.o_proj.weight": w(d, spec.num_heads * hd),
            }
        if spec.family == "qwen3":
            out |= {p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)}
        if spec.family == "deepseek_v3":
            sparse = i >= spec.first_k_dense_replace
        else:
            sparse = spec.moe and i not in spec.mlp_only_layers and (i + 1) % spec.decoder_sparse_step == 0
        if sparse:
            ff = spec.moe_intermediate_size
            out[p + "mlp.gate.weight"] = w(spec.num_experts, d) * 10  # peaky routing exercises top-k
            for e in range(spec.num_experts):
                q = f"{p}mlp.experts.{e}."
                out |= {q + "gate_proj.weight": w(ff, d), q + "up_proj.weight": w(ff, d), q + "down_proj.weight": w(d, ff)}
            if spec.family == "deepseek_v3":
                out[p + "mlp.gate.e_score_correction_bias"] = w(spec.num_experts)
                out |= _mlp(f"{p}mlp.shared_experts.", d, ff * spec.n_shared_experts, w) if spec.n_shared_experts else {}
        else:
            out |= _mlp(p + "mlp.", d, spec.intermediate_size, w)
    if spec.dtype == "bfloat16":
        out = {k: v.astype(ml_dtypes.bfloat16) for k, v in out.items()}
    return out


def _mlp(prefix: str, d: int, ff: int, w) -> dict[str, np.ndarray]:
    return {prefix + "gate_proj.weight": w(ff, d), prefix + "up_proj.weight": w(ff, d), prefix + "down_proj.weight": w(d, ff)}


def _latent_attention(spec: TinySpec, p: str, w, norm) -> dict[str, np.ndarray]:
    """DeepSeek-V3's attention tensors of one layer (qk_nope_head_dim = v_head_dim = head_dim)."""
    d, h, hd, rope, kv = spec.hidden_size, spec.num_heads, spec.head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
    a = p + "self_attn."
    out = {a + "kv_a_proj_with_mqa.weight": w(kv + rope, d), a + "kv_a_layernorm.weight": norm(kv),
           a + "kv_b_proj.weight": w(h * 2 * hd, kv), a + "o_proj.weight": w(d, h * hd)}
    if spec.q_lora_rank:
        return out | {a + "q_a_proj.weight": w(spec.q_lora_rank, d), a + "q_a_layernorm.weight": norm(spec.q_lora_rank),
                      a + "q_b_proj.weight": w(h * (hd + rope), spec.q_lora_rank)}
    return out | {a + "q_proj.weight": w(h * (hd + rope), d)}


def write_tiny_model(out_dir: str | Path, spec: TinySpec | None = None) -> Path:
    """Write the checkpoint and tokenizer to `out_dir` (created if needed); return the directory."""
    spec = spec or TinySpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_size = build_tokenizer(out)
    if tokenizer_size > spec.vocab_size:
        raise ValueError(f"vocab_size={spec.vocab_size} is smaller than the tokenizer ({tokenizer_size} tokens)")
    cfg = hf_config(spec)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tensors = random_weights(spec)
    names = list(tensors)
    if spec.shards == 1:
        save_file(tensors, out / "model.safetensors")
        return out
    weight_map = {}
    parts = np.array_split(np.arange(len(names)), spec.shards)
    for k, idx in enumerate(parts):
        fname = f"model-{k + 1:05d}-of-{spec.shards:05d}.safetensors"
        save_file({names[i]: tensors[names[i]] for i in idx}, out / fname)
        weight_map |= {names[i]: fname for i in idx}
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tx.models.tiny",
        description="Write a random Qwen3 (or Qwen3-MoE, Llama 3, DeepSeek-V3) checkpoint with a tokenizer in HF format, "
        "offline.",
    )
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    for name, field in TinySpec.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(flag, action="store_true", default=None, help=field.description or f"set {name}")
        elif name == "family":
            parser.add_argument(flag, choices=["qwen3", "llama", "deepseek_v3"], help=f"{field.description} (default qwen3)")
        elif name == "mlp_only_layers":
            parser.add_argument(flag, type=int, nargs="*", help="layer indices that keep a dense MLP")
        else:
            parser.add_argument(flag, help=f"{field.description or name} (default {field.default})")
    args = vars(parser.parse_args(argv))
    out_dir = args.pop("out_dir")
    spec = TinySpec.model_validate({k: v for k, v in args.items() if v is not None})
    path = write_tiny_model(out_dir, spec)
    st = SafetensorsDir(path)
    n_params = sum(int(np.prod(st.shape(k))) for k in st.keys())
    print(json.dumps({"wrote": str(path), "architecture": hf_config(spec)["architectures"][0], "params": int(n_params)}))


if __name__ == "__main__":
    main()
