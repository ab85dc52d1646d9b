"""Training throughput: tx forward_backward + optim_step vs transformers + PEFT, same workload, one run.

    python benchmarks/bench_train.py                       # ~100M-parameter Qwen3 shape, CPU-friendly
    python benchmarks/bench_train.py --hidden-size 256 --num-layers 2 --steps 2   # quick
    python benchmarks/bench_train.py --full                # full fine-tuning vs transformers + torch AdamW
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/bench_train.py --full --fsdp 4

Workloads: a batch of `--batch` rows of `--seq-len` tokens trained with cross-entropy, either all rows on
1 adapter, or the rows spread over `--adapters` adapters in the same batch. tx runs each step as one
forward_backward over the whole batch plus one optim_step per adapter present; PEFT, which cannot
train different adapters in one batch, runs one forward/backward + AdamW step per adapter on its rows.
Prints one JSON line per (framework, workload) and a ratio line per workload.

`--full`: the workload is full fine-tuning (every weight, AdamW) of the whole batch: tx's FullBackend
(`training_mode="full"`, `--full-precision` fp32 or bf16 with float32 masters, sharded over `--fsdp`
devices) against transformers + `torch.optim.AdamW` in float32. tx's line also reports the bytes its
training state holds on one device (weights, masters, gradient sums, Adam moments) next to the expected
bytes / fsdp.
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


def full_batch(rows: list[list[int]], seq_len: int):
    from tx import types

    return types.PreparedModelPassBatch(
        all_input_ids=[r[:-1] for r in rows], all_targets=[r[1:] for r in rows],
        all_token_weights=[[1.0] * seq_len for _ in rows], all_sampling_logprobs=[[] for _ in rows],
        all_advantages=[[] for _ in rows], all_model_ids=["m"] * len(rows),
        all_loss_fns=["cross_entropy"] * len(rows), all_loss_fn_configs=[None] * len(rows),
        request_batch_slices=[("r", "m", 0, len(rows))])


def bench_tx_full(model_dir: Path, args) -> dict:
    import jax

    import tx
    from tx import types

    backend = tx.FullBackend(str(model_dir), tx.JaxBackendConfig(
        training_mode="full", mixed_precision=args.full_precision, max_seq_len=args.seq_len + 1,
        fully_sharded_data_parallel_size=args.fsdp, gradient_checkpointing=args.gradient_checkpointing,
        attention_impl=args.attention_impl))
    backend.create_model("m", types.LoraConfig(rank=0))
    adam = types.AdamParams(learning_rate=1e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    times = []
    with PeakRSS() as mem:
        for i, (rows, _) in enumerate(make_batches(args, backend.model.config.vocab_size, 1)):
            start = time.perf_counter()
            out = backend.forward_backward(full_batch(rows, args.seq_len))
            assert isinstance(out["r"], types.ForwardBackwardOutput), out["r"]
            backend.optim_step("m", types.OptimStepInput(adam_params=adam))
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
    held = backend.state_bytes()
    n = sum(x.size for x in jax.tree.leaves(backend.master_weights("m")))
    param_bytes = 2 if args.full_precision == "bf16" else 4
    expected = {"params": n * param_bytes, "masters": n * 4 if param_bytes == 2 else 0, "grad_sums": n * 4,
                "adam": n * 8}
    return {"framework": "tx", "compiles": sum(backend.metrics.compiles.values()), "times": times,
            "peak_rss_mb": mem.peak / 2**20, "device": jax.devices()[0].device_kind, "fsdp": args.fsdp,
            "precision": args.full_precision,
            "state_mib_per_device": {k: round(v / 2**20, 2) for k, v in held.items()},
            "expected_mib_per_device": {k: round(v / args.fsdp / 2**20, 2) for k, v in expected.items()}}


def bench_torch_full(model_dir: Path, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    times = []
    with PeakRSS() as mem:
        for i, (rows, _) in enumerate(make_batches(args, model.config.vocab_size, 1)):
            start = time.perf_counter()
            tokens = torch.tensor(rows)
            logits = model(input_ids=tokens[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                     tokens[:, 1:].reshape(-1), reduction="sum")
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
    return {"framework": "transformers+torch_adamw", "compiles": 0, "times": times, "peak_rss_mb": mem.peak / 2**20,
            "device": "cpu", "precision": "fp32", "torch_threads": torch.get_num_threads()}


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


def report(args, shapes: dict, workload: str, runners: list) -> None:
    """Run each framework, print its JSON line, then tx's tokens/s over the peer's."""
    rows = []
    for run in runners:
        r = run()
        step = float(np.median(r.pop("times")))
        r |= {"workload": workload, "shapes": shapes, "step_time_s": round(step, 4),
              "tokens_per_s": round(args.batch * args.seq_len / step, 1), "peak_rss_mb": round(r["peak_rss_mb"])}
        rows.append(r)
        print(json.dumps(r), flush=True)
    if len(rows) == 2:
        peer = rows[1]["framework"].split("+")[-1]  # peft, torch_adamw
        ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
        print(json.dumps({"workload": workload, f"ratio_tx_over_{peer}_tokens_per_s": round(ratio, 3)}), flush=True)


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
    parser.add_argument("--full", action="store_true", help="benchmark full fine-tuning (every weight) instead of LoRA")
    parser.add_argument("--full-precision", choices=["fp32", "bf16"], default="fp32",
                        help="--full: tx's param_dtype (bf16 keeps float32 master weights)")
    parser.add_argument("--fsdp", type=int, default=1, help="--full: devices tx shards the training state over")
    args = parser.parse_args()

    with random_model(args) as (model_dir, params):
        shapes = {"family": args.family, "params": params, "batch": args.batch, "seq_len": args.seq_len,
                  "hidden": args.hidden_size, "layers": args.num_layers, "vocab": args.vocab_size, "rank": RANK,
                  "gradient_checkpointing": args.gradient_checkpointing, "attention_impl": args.attention_impl}
        if args.full:
            runners = [lambda: bench_tx_full(model_dir, args)]
            runners += [] if args.skip_peft else [lambda: bench_torch_full(model_dir, args)]
            report(args, shapes | {"fsdp": args.fsdp, "precision": args.full_precision}, "train_full", runners)
        for adapters in () if args.full else (1, args.adapters):
            runners = [lambda: bench_tx(model_dir, args, adapters)]
            runners += [] if args.skip_peft else [lambda: bench_peft(model_dir, args, adapters)]
            report(args, shapes, f"train_{adapters}_adapter{'s' if adapters > 1 else ''}", runners)
    print(json.dumps({"max_rss_mb_process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))


if __name__ == "__main__":
    main()
