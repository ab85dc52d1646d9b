"""One adapter <-> a PEFT LoRA directory (`adapter_config.json` + `adapter_model.safetensors`).

Dense modules use PEFT's usual names and layouts: `base_model.model.<module>.lora_A.weight [r, in]`,
`lora_B.weight [out, r]`. MoE experts use PEFT's `target_parameters` form for transformers 5's fused
expert tensors (`ParamWrapper`): `lora_A [r*E, in]` (expert-major), `lora_B [out, r*E]` (rank-major);
gate_up_proj is the inner wrapper (`experts.base_layer`) and down_proj the outer (`experts`). tx trains
separate gate and up factors per expert; they are exported exactly as one rank-2r gate_up LoRA with
stacked A and block-diagonal B (`rank_pattern` / `alpha_pattern` keep the scaling), and an imported
block-diagonal gate_up is split back into the two rank-r factors. A gate_up LoRA trained elsewhere
(shared A) imports as rank r with that A in both projections.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from tx.models.adapters import get_adapter_weights
from tx.models.safetensors_io import SafetensorsDir, save_file

PREFIX = "base_model.model."
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
Weights = dict[str, tuple[np.ndarray, np.ndarray]]


def _fuse_gate_up(gate: tuple[np.ndarray, np.ndarray], up: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-expert (A [E, r, D], B [E, F, r]) pairs -> PEFT gate_up lora_A [2r*E, D], lora_B [2F, 2r*E]."""
    (a_g, b_g), (a_u, b_u) = gate, up
    e, r, d = a_g.shape
    f = b_g.shape[1]
    a = np.concatenate([a_g, a_u], axis=1)  # [E, 2r, D]
    b = np.zeros((e, 2 * f, 2 * r), np.float32)
    b[:, :f, :r], b[:, f:, r:] = b_g, b_u
    return a.reshape(e * 2 * r, d), b.transpose(1, 2, 0).reshape(2 * f, 2 * r * e)


def _experts_to_peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-expert A [E, r, in], B [E, out, r] -> lora_A [r*E, in], lora_B [out, r*E]."""
    e, r, i = a.shape
    return a.reshape(e * r, i), b.transpose(1, 2, 0).reshape(b.shape[1], r * e)


def _experts_from_peft(lora_a: np.ndarray, lora_b: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    r = lora_a.shape[0] // num_experts
    return lora_a.reshape(num_experts, r, -1), lora_b.reshape(lora_b.shape[0], r, num_experts).transpose(2, 0, 1)


def export_adapter(model: Any, slot: int, rank: int, alpha: float, base_model: str, out_dir: Path) -> dict:
    """Write the adapter in `slot` as a PEFT directory; return the adapter config written."""
    weights = get_adapter_weights(model, slot, rank)
    tensors: dict[str, np.ndarray] = {}
    target_modules: set[str] = set()
    expert_layers = sorted({name.rsplit(".mlp.experts.", 1)[0] for name in weights if ".mlp.experts." in name})
    for name, (a, b) in weights.items():
        if ".mlp.experts." in name:
            continue
        tensors[f"{PREFIX}{name}.lora_A.weight"] = a
        tensors[f"{PREFIX}{name}.lora_B.weight"] = b
        target_modules.add(name.rsplit(".", 1)[-1])
    for layer in expert_layers:
        get = lambda proj: weights[f"{layer}.mlp.experts.{proj}"]  # noqa: E731
        a, b = _fuse_gate_up(get("gate_proj"), get("up_proj"))
        tensors[f"{PREFIX}{layer}.mlp.experts.base_layer.lora_A.weight"] = a
        tensors[f"{PREFIX}{layer}.mlp.experts.base_layer.lora_B.weight"] = b
        a, b = _experts_to_peft(*get("down_proj"))
        tensors[f"{PREFIX}{layer}.mlp.experts.lora_A.weight"] = a
        tensors[f"{PREFIX}{layer}.mlp.experts.lora_B.weight"] = b
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(target_modules),
        "target_parameters": [GATE_UP, DOWN] if expert_layers else None,
        "rank_pattern": {GATE_UP: 2 * rank} if expert_layers else {},
        "alpha_pattern": {GATE_UP: 2 * alpha} if expert_layers else {},
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, out_dir / "adapter_model.safetensors")
    return config


def _pattern_value(patterns: dict, name: str, default: float) -> float:
    """PEFT's rank/alpha patterns: a key matches a module whose name ends with it, or as a full regex."""
    for key, value in (patterns or {}).items():
        if name == key or name.endswith("." + key) or re.fullmatch(key, name):
            return value
    return default


def import_adapter(model: Any, adapter_dir: Path, max_rank: int) -> tuple[Weights, int, float]:
    """Read a PEFT directory into `set_adapter_weights` form: (weights, rank, alpha).

    Modules with their own rank / alpha (rank_pattern, alpha_pattern) are folded into one adapter-wide
    scaling (B rescaled) and zero-padded to the largest rank, which must not exceed `max_rank`."""
    cfg_path = adapter_dir / "adapter_config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"no adapter_config.json in {adapter_dir}")
    config = json.loads(cfg_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type={config.get('peft_type')!r} is not supported (only LORA)")
    for flag in ("use_rslora", "use_dora"):
        if config.get(flag):
            raise ValueError(f"adapter uses {flag}=true, which tx does not support")
    files = SafetensorsDir(adapter_dir)
    r0, alpha0 = int(config["r"]), float(config["lora_alpha"])
    cfg = model.config
    raw: dict[str, tuple[np.ndarray, np.ndarray, float]] = {}  # module -> (A, B, its scaling)
    for key in files.keys():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(PREFIX).removesuffix(".lora_A.weight")
        lora_a = np.asarray(files.get(key), np.float32)
        lora_b = np.asarray(files.get(key.replace(".lora_A.", ".lora_B.")), np.float32)
        if not module.endswith(("mlp.experts", "mlp.experts.base_layer")):
            r = lora_a.shape[0]
            alpha = _pattern_value(config.get("alpha_pattern"), module, alpha0)
            raw[module] = (lora_a, lora_b, alpha / _pattern_value(config.get("rank_pattern"), module, r0))
            continue
        layer = module.split(".mlp.experts")[0]
        is_gate_up = lora_a.shape[1] == cfg.hidden_size and (
            cfg.hidden_size != cfg.moe_intermediate_size or module.endswith("base_layer"))
        param = f"{layer}.{GATE_UP if is_gate_up else DOWN}"
        scale = _pattern_value(config.get("alpha_pattern"), param, alpha0) / _pattern_value(
            config.get("rank_pattern"), param, r0)
        a, b = _experts_from_peft(lora_a, lora_b, cfg.num_experts)  # [E, r, in], [E, out, r]
        if not is_gate_up:
            raw[f"{layer}.mlp.experts.down_proj"] = (a, b, scale)
            continue
        f, r = b.shape[1] // 2, a.shape[1]
        h = r // 2
        block_diagonal = r % 2 == 0 and not np.any(b[:, :f, h:]) and not np.any(b[:, f:, :h])
        if block_diagonal:
            raw[f"{layer}.mlp.experts.gate_proj"] = (a[:, :h], b[:, :f, :h], scale)
            raw[f"{layer}.mlp.experts.up_proj"] = (a[:, h:], b[:, f:, h:], scale)
        else:
            raw[f"{layer}.mlp.experts.gate_proj"] = (a, b[:, :f], scale)
            raw[f"{layer}.mlp.experts.up_proj"] = (a, b[:, f:], scale)
    if not raw:
        raise ValueError(f"no LoRA tensors in {adapter_dir / 'adapter_model.safetensors'}")
    rank = max(a.shape[-2] for a, _, _ in raw.values())
    if rank > max_rank:
        raise ValueError(f"adapter rank {rank} exceeds max_lora_rank={max_rank}")
    alpha = float(rank)  # adapter-wide scaling 1: each module's own scaling goes into its B
    weights: Weights = {}
    for name, (a, b, scale) in raw.items():
        r = a.shape[-2]
        a_pad = np.zeros((*a.shape[:-2], rank, a.shape[-1]), np.float32)
        b_pad = np.zeros((*b.shape[:-1], rank), np.float32)
        a_pad[..., :r, :], b_pad[..., :r] = a, b * scale
        weights[name] = (a_pad, b_pad)
    return weights, rank, alpha
