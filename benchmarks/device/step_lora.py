"""Step b: LoRA training throughput and MFU at the Qwen3-1.7B shape through tx's JaxBackend.

One backend (bf16 base weights, `max_lora_adapters` = adapters + 1, rank `rank` on every linear layer and the
LM head, attention_impl "auto": cuDNN on GPU, no gradient checkpointing, as PEFT's default) serves both
workloads, so they share one compiled forward_backward: `rows` x `seq_len` tokens per step (cross-entropy,
weight 1), all rows on one adapter (`lora_train_1_adapter`) or row i on adapter i % 8
(`lora_train_8_adapters`). `step_time_s` / `tokens_per_s` / `mfu` are of forward_backward alone (median of
`steps` calls after `warmup`); optim_step of every adapter present is timed separately (`optim_step_s`, all
of them; `step_with_optim_s` = both). MFU counts the FLOPs in suite.lora_train_flops (METHOD.md); `mfu_6n`
is the 6 N tokens convention.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from suite import (Device, Results, jax_step, lora_params, lora_shapes, lora_train_flops, lora_workload,
                   matmul_params, mfu)

MODEL = "qwen3_1p7b"


def token_rows(rng, rows: int, seq_len: int, vocab: int) -> list[list[int]]:
    return rng.integers(0, vocab, (rows, seq_len + 1)).tolist()


def train_batch(rows: list[list[int]], owners: list[str]):
    from tx import types

    n = len(rows)
    return types.PreparedModelPassBatch(
        all_input_ids=[r[:-1] for r in rows], all_targets=[r[1:] for r in rows],
        all_token_weights=[[1.0] * (len(r) - 1) for r in rows], all_sampling_logprobs=[[] for _ in rows],
        all_advantages=[[] for _ in rows], all_model_ids=owners, all_loss_fns=["cross_entropy"] * n,
        all_loss_fn_configs=[None] * n,
        request_batch_slices=[(f"r{i}", owners[i], i, i + 1) for i in range(n)])


def run_workload(results: Results, device: Device, backend, m, w: dict, adapters: int) -> None:
    from tx import types

    name = lora_workload(adapters)
    with results.workload(name) as row:
        rows, seq_len, rank = w["rows"], w["seq_len"], w["rank"]
        tokens = rows * seq_len
        row["shapes"] = lora_shapes(MODEL, m, w, adapters, attention_impl=backend.config.attention_impl)
        owners = [f"m{i % adapters}" for i in range(rows)]
        rng = np.random.default_rng(adapters)
        adam = types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-5))
        fb_times, opt_times = [], []
        compiles_before_timing = None
        for i in range(w["warmup"] + w["steps"]):
            if i == w["warmup"]:
                compiles_before_timing = sum(backend.metrics.compiles.values())
            batch = train_batch(token_rows(rng, rows, seq_len, m.vocab_size), owners)
            start = time.perf_counter()
            out = backend.forward_backward(batch)  # returns host values: synchronous
            mid = time.perf_counter()
            for a in sorted(set(owners)):
                backend.optim_step(a, adam)
            end = time.perf_counter()
            bad = [r for r, o in out.items() if not isinstance(o, types.ForwardBackwardOutput)]
            if bad:
                raise RuntimeError(f"forward_backward failed: {out[bad[0]]}")
            if i >= w["warmup"]:
                fb_times.append(mid - start)
                opt_times.append(end - mid)
        fb, opt = statistics.median(fb_times), statistics.median(opt_times)
        flops = lora_train_flops(m, rank, tokens, seq_len)
        row.update({
            "step_time_s": round(fb, 5), "tokens_per_s": round(tokens / fb, 1),
            "optim_step_s": round(opt, 5), "optim_steps_per_step": len(set(owners)),
            "step_with_optim_s": round(fb + opt, 5), "tokens_per_s_with_optim": round(tokens / (fb + opt), 1),
            "forward_backward_times_s": [round(t, 5) for t in fb_times],
            "compiles": sum(backend.metrics.compiles.values()),
            "compiles_during_timing": sum(backend.metrics.compiles.values()) - compiles_before_timing,
            "compiles_by_program": dict(backend.metrics.compiles),
            "model_flops_per_step": flops, "matmul_params": matmul_params(m), "lora_params_per_adapter":
                lora_params(m, rank),
            "mfu": mfu(flops, fb, device.peak_flops),
            "mfu_6n": mfu(6 * matmul_params(m) * tokens, fb, device.peak_flops),
            "peak_tflops": device.peak_flops and device.peak_flops / 1e12,
        })


def main() -> None:
    args, device, results, w, m = jax_step("b", __doc__, "lora", MODEL)
    backend, error = None, None
    try:
        import tx
        from tx import types

        backend = tx.JaxBackend(str(Path(args.models) / MODEL), tx.JaxBackendConfig(
            max_lora_adapters=w["adapters"] + 1, max_lora_rank=w["rank"], max_seq_len=w["seq_len"] + 1,
            gradient_checkpointing=False, attention_impl="auto"))
        for a in range(w["adapters"]):
            backend.create_model(f"m{a}", types.LoraConfig(rank=w["rank"], alpha=2.0 * w["rank"], seed=a))
    except Exception as exc:  # noqa: BLE001 - every workload reports it
        error = exc
    for adapters in (1, w["adapters"]):
        if error is not None:
            with results.workload(lora_workload(adapters)):
                raise RuntimeError(f"backend setup failed: {type(error).__name__}: {error}")
        else:
            run_workload(results, device, backend, m, w, adapters)


if __name__ == "__main__":
    main()
