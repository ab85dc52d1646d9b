"""Peak memory and tokens/s of one LoRA forward_backward vs sequence length, per attention impl, next to
transformers + PEFT (sdpa attention) on the same workload.

    python benchmarks/bench_memory.py                      # Qwen3-0.6B layer shape, 2 layers, 1k..16k tokens
    python benchmarks/bench_memory.py --long               # also 32k
    python benchmarks/bench_memory.py --lengths 1024 2048 --impls blockwise reference   # quick

Workload: ONE row of `seq_len` tokens, cross-entropy on every token, a rank-16 LoRA adapter on every
linear layer and the LM head, trained through `JaxBackend.forward_backward` with the backend's defaults
(gradient checkpointing with `--remat-policy`, token-budgeted micro-batches). The model is a random
checkpoint of the given shape (default: Qwen3-0.6B's layers: hidden 1024, 16 q / 8 kv heads of 128,
intermediate 3072, vocab 151,936, tied embeddings).

Every measurement runs in its own process, so peaks do not mix: `base_rss_bytes` is the process's
resident memory once the model is loaded, `peak_rss_bytes` the highest it reached during the compile and
`--steps` calls (sampled every 5 ms); on a GPU/TPU `device_peak_bytes` is the allocator's peak. The
dense `reference` attention and transformers + PEFT are only run up to `--peer-max-len` tokens (their
memory grows with t^2 and with t x vocab). One JSON line per (framework, impl, seq_len), then ratio lines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import PeakRSS, add_model_args, model_spec

RANK = 16
SHAPE_FLAGS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def write_model(args: argparse.Namespace, directory: Path) -> Path:
    from tx.models.tiny import write_tiny_model

    spec = model_spec(args, tie_word_embeddings=True, max_position_embeddings=max(32768, max(args.lengths) + 1))
    return write_tiny_model(directory / "model", spec)


def run_tx(args: argparse.Namespace) -> dict:
    import jax
    import numpy as np

    import tx
    from tx import types

    config = tx.JaxBackendConfig(max_lora_adapters=2, max_lora_rank=RANK, attention_impl=args.impl,
                                 gradient_checkpointing=args.remat_policy != "none",
                                 **({} if args.remat_policy == "none" else {"remat_policy": args.remat_policy}))
    backend = tx.JaxBackend(args.model_dir, config)
    backend.create_model("m", types.LoraConfig(rank=RANK, seed=1))
    n = args.seq_len
    ids = np.random.default_rng(0).integers(0, args.vocab_size, n + 1).tolist()
    batch = types.PreparedModelPassBatch(
        all_input_ids=[ids[:-1]], all_targets=[ids[1:]], all_token_weights=[[1.0] * n],
        all_sampling_logprobs=[[]], all_advantages=[[]], all_model_ids=["m"], all_loss_fns=["cross_entropy"],
        all_loss_fn_configs=[None], request_batch_slices=[("r", "m", 0, 1)],
    )
    base = rss()
    times = []
    with PeakRSS() as mem:
        for _ in range(args.steps + 1):  # the first call compiles
            start = time.perf_counter()
            out = backend.forward_backward(batch)["r"]
            assert isinstance(out, types.ForwardBackwardOutput), out
            times.append(time.perf_counter() - start)
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    return {"framework": "tx", "impl": args.impl, "remat_policy": args.remat_policy, "times": times[1:],
            "base_rss_bytes": base, "peak_rss_bytes": mem.peak, "device": device.device_kind,
            "device_peak_bytes": (stats or {}).get("peak_bytes_in_use"),
            "compiles": sum(backend.metrics.compiles.values())}


def run_peft(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=32, target_modules=targets))
    if args.remat_policy != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    ids = torch.tensor(np.random.default_rng(0).integers(0, args.vocab_size, (1, args.seq_len + 1)))
    base = rss()
    times = []
    with PeakRSS() as mem:
        for _ in range(args.steps + 1):
            start = time.perf_counter()
            logits = model(input_ids=ids[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits[0].float(), ids[0, 1:], reduction="sum")
            loss.backward()
            model.zero_grad(set_to_none=True)
            del logits, loss
            times.append(time.perf_counter() - start)
    return {"framework": "transformers+peft", "impl": "sdpa", "remat_policy": args.remat_policy,
            "times": times[1:], "base_rss_bytes": base, "peak_rss_bytes": mem.peak, "device": "cpu",
            "torch_threads": torch.get_num_threads()}


def one(args: argparse.Namespace) -> None:
    import numpy as np

    r = (run_peft if args.framework == "peft" else run_tx)(args)
    step = float(np.median(r.pop("times")))
    shapes = {"seq_len": args.seq_len, "rows": 1, "hidden": args.hidden_size, "layers": args.num_layers,
              "heads": args.num_heads, "kv_heads": args.num_kv_heads, "head_dim": args.head_dim,
              "intermediate": args.intermediate_size, "vocab": args.vocab_size, "rank": RANK}
    r |= {"workload": "lora_forward_backward", "shapes": shapes, "step_time_s": round(step, 3),
          "tokens_per_s": round(args.seq_len / step, 1)}
    print("RESULT " + json.dumps(r), flush=True)


def measure(args: argparse.Namespace, model_dir: Path, framework: str, impl: str, seq_len: int) -> dict | None:
    cmd = [sys.executable, __file__, "--one", "--framework", framework, "--impl", impl, "--seq-len", str(seq_len),
           "--model-dir", str(model_dir), "--steps", str(args.steps), "--remat-policy", args.remat_policy,
           *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in SHAPE_FLAGS]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"framework": framework, "impl": impl, "shapes": {"seq_len": seq_len}, "error": " | ".join(tail),
            "returncode": proc.returncode}


def default_impls() -> list[str]:
    import jax

    platform = jax.devices()[0].platform
    return {"gpu": ["cudnn", "blockwise", "reference"], "tpu": ["splash", "blockwise", "reference"]}.get(
        platform, ["blockwise", "reference"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=1024, layers=2, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
                   vocab=151936)  # Qwen3-0.6B's layer shape, tied embeddings
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--long", action="store_true", help="also 32768 tokens")
    parser.add_argument("--impls", nargs="+", default=None, help="attention impls (default: those of the platform)")
    parser.add_argument("--remat-policy", default="layer", help="'none' turns gradient checkpointing off")
    parser.add_argument("--peer-max-len", type=int, default=4096,
                        help="longest sequence for the dense reference and transformers+PEFT")
    parser.add_argument("--skip-peft", action="store_true")
    parser.add_argument("--steps", type=int, default=2, help="measured calls after the compiling one")
    # internal: one measurement in this process
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--framework", default="tx", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return one(args)
    lengths = sorted(set(args.lengths + ([32768] if args.long else [])))
    args.lengths = lengths
    impls = args.impls or default_impls()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(args, Path(tmp))
        for seq_len in lengths:
            rows = {}
            runs = [("tx", impl) for impl in impls if impl != "reference" or seq_len <= args.peer_max_len]
            if not args.skip_peft and seq_len <= args.peer_max_len:
                runs.append(("peft", "sdpa"))
            for framework, impl in runs:
                r = measure(args, model_dir, framework, impl, seq_len)
                rows[(framework, impl)] = r
                print(json.dumps(r), flush=True)
            for (framework, impl), r in rows.items():
                for peer in (("tx", "reference"), ("peft", "sdpa")):
                    other = rows.get(peer)
                    if (framework, impl) == peer or framework != "tx" or not other or "error" in r or "error" in other:
                        continue
                    print(json.dumps({"workload": "lora_forward_backward", "seq_len": seq_len, "impl": impl,
                                      "vs": f"{peer[0]}:{peer[1]}",
                                      "tokens_per_s_ratio": round(r["tokens_per_s"] / other["tokens_per_s"], 3),
                                      "peak_rss_ratio": round(r["peak_rss_bytes"] / other["peak_rss_bytes"], 3)}),
                          flush=True)


if __name__ == "__main__":
    main()
