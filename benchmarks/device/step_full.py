"""Step c: full fine-tuning step time and MFU at the Qwen3-0.6B shape through tx's FullBackend.

training_mode="full" with the default mixed precision (bf16 weights the model computes with, float32
master weights, gradient sums and Adam moments), no gradient checkpointing, attention_impl "auto" (cuDNN on
GPU). A step is one forward_backward of `rows` x `seq_len` tokens plus one optim_step; `step_time_s` is
both (median of `steps` after `warmup`), with each part reported too. MFU: suite.full_train_flops (6 N per
token + attention) over the whole step; `mfu_6n` without attention.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from suite import full_train_flops, jax_step, matmul_params, mfu

MODEL = "qwen3_0p6b"


def main() -> None:
    args, device, results, w, m = jax_step("c", __doc__, "full", MODEL)
    with results.workload("full_train") as row:
        import tx
        from tx import types

        rows, seq_len = w["rows"], w["seq_len"]
        tokens = rows * seq_len
        row["shapes"] = {"model": MODEL, **vars(m), "rows": rows, "seq_len": seq_len, "tokens_per_step": tokens,
                         "precision": "bf16 params, fp32 masters/grad sums/Adam", "gradient_checkpointing": False}
        backend = tx.FullBackend(str(Path(args.models) / MODEL), tx.JaxBackendConfig(
            training_mode="full", max_seq_len=seq_len + 1, gradient_checkpointing=False, attention_impl="auto"))
        backend.create_model("m", types.LoraConfig(rank=0))
        row["shapes"]["attention_impl"] = backend.config.attention_impl
        adam = types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-6, beta1=0.9, beta2=0.95,
                                                                 eps=1e-8, weight_decay=0.0))
        rng = np.random.default_rng(0)
        fb_times, opt_times, compiles_before = [], [], None
        for i in range(w["warmup"] + w["steps"]):
            if i == w["warmup"]:
                compiles_before = sum(backend.metrics.compiles.values())
            ids = rng.integers(0, m.vocab_size, (rows, seq_len + 1)).tolist()
            batch = types.PreparedModelPassBatch(
                all_input_ids=[r[:-1] for r in ids], all_targets=[r[1:] for r in ids],
                all_token_weights=[[1.0] * seq_len for _ in ids], all_sampling_logprobs=[[] for _ in ids],
                all_advantages=[[] for _ in ids], all_model_ids=["m"] * rows, all_loss_fns=["cross_entropy"] * rows,
                all_loss_fn_configs=[None] * rows, request_batch_slices=[("r", "m", 0, rows)])
            start = time.perf_counter()
            out = backend.forward_backward(batch)
            mid = time.perf_counter()
            backend.optim_step("m", adam)
            end = time.perf_counter()
            if not isinstance(out["r"], types.ForwardBackwardOutput):
                raise RuntimeError(f"forward_backward failed: {out['r']}")
            if i >= w["warmup"]:
                fb_times.append(mid - start)
                opt_times.append(end - mid)
        fb, opt = statistics.median(fb_times), statistics.median(opt_times)
        step = fb + opt
        flops = full_train_flops(m, tokens, seq_len)
        row.update({
            "step_time_s": round(step, 5), "tokens_per_s": round(tokens / step, 1),
            "forward_backward_s": round(fb, 5), "optim_step_s": round(opt, 5),
            "compiles": sum(backend.metrics.compiles.values()),
            "compiles_during_timing": sum(backend.metrics.compiles.values()) - compiles_before,
            "compiles_by_program": dict(backend.metrics.compiles),
            "model_flops_per_step": flops, "matmul_params": matmul_params(m),
            "mfu": mfu(flops, step, device.peak_flops),
            "mfu_6n": mfu(6 * matmul_params(m) * tokens, step, device.peak_flops),
            "peak_tflops": device.peak_flops and device.peak_flops / 1e12,
            "state_mib": {k: round(v / 2**20, 1) for k, v in backend.state_bytes().items()},
        })


if __name__ == "__main__":
    main()
