"""Qwen3-MoE forward (and forward+backward) time: tx, per grouped-matmul kernel, vs transformers, one run.

    python benchmarks/bench_moe.py                 # Qwen3-30B-A3B expert shape: 128 experts, top-8, width 768
    python benchmarks/bench_moe.py --num-experts 16 --tokens 64 --steps 1   # quick

A random Qwen3-MoE checkpoint (every layer sparse) is written locally. Workloads on one row of
`--tokens` tokens:
- `forward`: tx per-token target log-probs (no adapter) vs transformers' logits, both float32;
- `forward_lora`: the same tx pass with a rank-16 adapter on every projection and expert;
- `forward_backward`: tx gradients of the summed log-probs wrt that adapter (what training computes) vs
  transformers' backward of the same sum with frozen weights (gradient wrt the input embeddings only:
  the activation backward through every layer, no weight gradients).
transformers runs with each expert implementation named in `--hf-experts` (`eager`, the default here: a
Python loop over the experts hit; `grouped_mm`, transformers' own default: torch's grouped GEMM, whose
CPU fallback measured 0.6-6 s per forward here, slower than eager); ratios are against the fastest.
Prints one JSON line per (framework, impl, workload) and one ratio line per (impl, workload).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from common import add_model_args, model_spec

RANK = 16


def timed(fn, steps: int, warmup: int) -> float:
    """Median seconds of `fn()` over `steps` calls after `warmup` unmeasured ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def write_model(args, root: Path) -> Path:
    from tx.models.tiny import write_tiny_model

    spec = model_spec(args, moe=True, num_experts=args.num_experts, num_experts_per_tok=args.top_k,
                      moe_intermediate_size=args.moe_intermediate_size)
    return write_tiny_model(root / "model", spec)


def bench_tx(model_dir: Path, args, impl: str, ids: np.ndarray) -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tx.models.adapters import init_adapter
    from tx.models.config import LoraSlots
    from tx.models.layers.lora import LoraA, LoraB
    from tx.models.loading import load_model

    model = load_model(model_dir, LoraSlots(max_lora_adapters=2, max_lora_rank=RANK), moe_impl=impl)
    init_adapter(model, 1, rank=RANK, alpha=2 * RANK, seed=0)
    graphdef, lora, frozen = nnx.split(model, (LoraA, LoraB), ...)
    tokens = jnp.asarray(ids[:, :-1])
    targets = jnp.asarray(ids[:, 1:])
    mask = jnp.ones_like(tokens)

    def summed_logprobs(lora, frozen, adapter_b):
        m = nnx.merge(graphdef, lora, frozen)
        hidden = m(tokens, mask, adapter_b)
        return jnp.sum(m.target_logprobs(hidden, targets, adapter_b, chunk_size=args.tokens))

    base = jax.jit(lambda lora, frozen: summed_logprobs(lora, frozen, None))
    adapted = jax.jit(lambda lora, frozen: summed_logprobs(lora, frozen, jnp.ones((1,), jnp.int32)))
    grads = jax.jit(jax.grad(lambda lora, frozen: summed_logprobs(lora, frozen, jnp.ones((1,), jnp.int32))))
    runs = {"forward": base, "forward_lora": adapted}
    if not args.skip_backward and impl in args.backward_impls.split(","):
        runs["forward_backward"] = grads
    steps = args.steps if impl == "blocked" else 1
    return {name: timed(lambda: jax.block_until_ready(fn(lora, frozen)), steps, args.warmup)
            for name, fn in runs.items()}


def bench_transformers(model_dir: Path, args, experts_impl: str, ids: np.ndarray) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 experts_implementation=experts_impl).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tokens = torch.tensor(ids[:, :-1])
    targets = torch.tensor(ids[:, 1:])

    def forward():
        with torch.no_grad():
            model(input_ids=tokens)

    def forward_backward():
        embeds = model.get_input_embeddings()(tokens).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])
        logprobs.sum().backward()

    out = {"forward": timed(forward, args.steps, args.warmup)}
    if not args.skip_backward:
        out["forward_backward"] = timed(forward_backward, args.steps, args.warmup)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, hidden=1024, layers=2, heads=16, kv_heads=8, head_dim=128, intermediate=3072)
    parser.add_argument("--num-experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--moe-intermediate-size", type=int, default=768, help="Qwen3-30B-A3B's expert width")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--impls", default="blocked,ragged_dot",
                        help="tx grouped-matmul kernels (megablox only on TPU: interpret mode is for tests)")
    parser.add_argument("--backward-impls", default="blocked", help="kernels also timed forward+backward")
    parser.add_argument("--hf-experts", default="eager", help="transformers experts_implementation(s)")
    parser.add_argument("--steps", type=int, default=3, help="measured calls (1 for the slow ragged_dot)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured calls (compilation)")
    parser.add_argument("--skip-backward", action="store_true")
    args = parser.parse_args()

    import jax
    import torch

    device = jax.devices()[0].device_kind
    ids = np.random.default_rng(0).integers(0, args.vocab_size, (1, args.tokens + 1))
    shapes = {"hidden": args.hidden_size, "layers": args.num_layers, "experts": args.num_experts,
              "top_k": args.top_k, "moe_intermediate": args.moe_intermediate_size, "tokens": args.tokens,
              "vocab": args.vocab_size, "rank": RANK}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(args, Path(tmp))
        results: dict[tuple[str, str], dict[str, float]] = {}
        runs = [("transformers", e, bench_transformers) for e in args.hf_experts.split(",")]
        runs += [("tx", i, bench_tx) for i in args.impls.split(",")]
        for framework, impl, bench in runs:
            results[(framework, impl)] = times = bench(model_dir, args, impl, ids)
            extra = {"torch_threads": torch.get_num_threads()} if framework == "transformers" else {}
            for workload, seconds in times.items():
                print(json.dumps({"framework": framework, "impl": impl, "workload": workload, "shapes": shapes,
                                  "time_s": round(seconds, 4), "tokens_per_s": round(args.tokens / seconds, 1),
                                  "device": "cpu" if framework == "transformers" else device, **extra}), flush=True)
        for workload in ("forward", "forward_lora", "forward_backward"):
            hf = [t["forward" if workload == "forward_lora" else workload] for (f, _), t in results.items()
                  if f == "transformers" and workload.replace("_lora", "") in t]
            for (framework, impl), times in results.items():
                if framework == "tx" and workload in times and hf:
                    print(json.dumps({"workload": workload, "impl": impl,
                                      "ratio_tx_time_over_transformers_best": round(times[workload] / min(hf), 3)}),
                          flush=True)


if __name__ == "__main__":
    main()
