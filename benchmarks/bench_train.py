"""Training throughput: tx forward_backward + optim_step vs transformers + PEFT, same workload, one run.

    python benchmarks/bench_train.py                       # ~100M-parameter Qwen3 shape, CPU-friendly
    python benchmarks/bench_train.py --hidden-size 256 --num-layers 2 --steps 2   # quick

Workloads: a batch of `--batch` rows of `--seq-len` tokens trained with cross-entropy, either all rows on
1 adapter, or the rows spread over `--adapters` adapters in the same batch. tx runs each step as one
forward_backward over the whole batch plus one optim_step per adapter present; PEFT, which cannot
train different adapters in one batch, runs one forward/backward + AdamW step per adapter on its rows.
Prints one JSON line per (framework, workload) and a ratio line per workload.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import numpy as np
from common import PeakRSS, add_model_args, random_model

RANK = 16


def make_batches(args, vocab: int, adapters: int) -> list[tuple[list[list[int]], list[int]]]:
    """Per step: token rows and the adapter index (0..adapters-1) of each row."""
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(args.steps + args.warmup):
        rows = rng.integers(0, vocab, (args.batch, args.seq_len + 1)).tolist()
        steps.append((rows, [i % adapters for i in range(args.batch)]))
    return steps


def bench_tx(model_dir: Path, args, adapters: int) -> dict:
    import jax

    import tx
    from tx import types

    backend = tx.JaxBackend(str(model_dir), tx.JaxBackendConfig(
        max_lora_adapters=adapters + 1, max_lora_rank=RANK, max_seq_len=args.seq_len + 1,
        gradient_checkpointing=args.gradient_checkpointing, attention_impl=args.attention_impl))
    for a in range(adapters):
        backend.create_model(f"m{a}", types.LoraConfig(rank=RANK, seed=a))
    times = []
    with PeakRSS() as mem:
        for i, (rows, owner) in enumerate(make_batches(args, backend.model.config.vocab_size, adapters)):
            start = time.perf_counter()
            batch = types.PreparedModelPassBatch(
                all_input_ids=[r[:-1] for r in rows], all_targets=[r[1:] for r in rows],
                all_token_weights=[[1.0] * args.seq_len for _ in rows], all_sampling_logprobs=[[] for _ in rows],
                all_advantages=[[] for _ in rows], all_model_ids=[f"m{a}" for a in owner],
                all_loss_fns=["cross_entropy"] * len(rows), all_loss_fn_configs=[None] * len(rows),
                request_batch_slices=[(f"r{j}", f"m{a}", j, j + 1) for j, a in enumerate(owner)],
            )
            out = backend.forward_backward(batch)
            assert all(isinstance(o, types.ForwardBackwardOutput) for o in out.values())
            for a in sorted(set(owner)):
                backend.optim_step(f"m{a}", types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-4)))
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
    return {"framework": "tx", "compiles": sum(backend.metrics.compiles.values()), "times": times,
            "peak_rss_mb": mem.peak / 2**20, "device": jax.devices()[0].device_kind}


def bench_peft(model_dir: Path, args, adapters: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    cfg = LoraConfig(r=RANK, lora_alpha=32, target_modules=targets)
    model = get_peft_model(base, cfg, adapter_name="m0")
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    for a in range(1, adapters):
        model.add_adapter(f"m{a}", cfg)
    optimizers = {}
    for a in range(adapters):
        model.set_adapter(f"m{a}")
        params = [p for n, p in model.named_parameters() if f".m{a}." in n]
        optimizers[a] = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    times = []
    with PeakRSS() as mem:
        for i, (rows, owner) in enumerate(make_batches(args, base.config.vocab_size, adapters)):
            start = time.perf_counter()
            tokens = torch.tensor(rows)
            for a in sorted(set(owner)):
                model.set_adapter(f"m{a}")
                mine = tokens[[j for j, o in enumerate(owner) if o == a]]
                logits = model(input_ids=mine[:, :-1]).logits
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(), mine[:, 1:].reshape(-1), reduction="sum")
                loss.backward()
                optimizers[a].step()
                optimizers[a].zero_grad(set_to_none=True)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
    return {"framework": "transformers+peft", "compiles": 0, "times": times, "peak_rss_mb": mem.peak / 2**20,
            "device": "cpu", "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, hidden=768, layers=8, heads=12, kv_heads=4, intermediate=2048)
    parser.add_argument("--batch", type=int, default=8, help="rows per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--adapters", type=int, default=8, help="adapters in the multi-adapter workload")
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps (compilation)")
    parser.add_argument("--skip-peft", action="store_true")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="both frameworks recompute each layer in the backward pass (default: neither does, "
                        "PEFT's default; tx's own default is on)")
    parser.add_argument("--attention-impl", default="auto", help="tx's attention kernel")
    args = parser.parse_args()

    with random_model(args) as (model_dir, params):
        shapes = {"params": params, "batch": args.batch, "seq_len": args.seq_len, "hidden": args.hidden_size,
                  "layers": args.num_layers, "vocab": args.vocab_size, "rank": RANK,
                  "gradient_checkpointing": args.gradient_checkpointing, "attention_impl": args.attention_impl}
        for adapters in (1, args.adapters):
            workload = f"train_{adapters}_adapter{'s' if adapters > 1 else ''}"
            rows = {}
            runners = [bench_tx] + ([] if args.skip_peft else [bench_peft])
            for run in runners:
                r = run(model_dir, args, adapters)
                step = float(np.median(r.pop("times")))
                r |= {"workload": workload, "shapes": shapes, "step_time_s": round(step, 4),
                      "tokens_per_s": round(args.batch * args.seq_len / step, 1), "peak_rss_mb": round(r["peak_rss_mb"])}
                rows[r["framework"]] = r
                print(json.dumps(r), flush=True)
            if len(rows) == 2:
                ratio = rows["tx"]["tokens_per_s"] / rows["transformers+peft"]["tokens_per_s"]
                print(json.dumps({"workload": workload, "ratio_tx_over_peft_tokens_per_s": round(ratio, 3)}), flush=True)
    print(json.dumps({"max_rss_mb_process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))


if __name__ == "__main__":
    main()
