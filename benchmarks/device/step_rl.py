"""Step e: the RL sampling workload (benchmarks/bench_sample.py --workload rl, paged engine) on the device.

`prompts` prompts of `prompt_len` random tokens, `samples` samples each (temperature 1, seeded, no stop),
`max_tokens` per request drawn uniformly in the `max_tokens` range, Qwen3-1.7B shape, bf16, one LoRA
adapter; all in one `backend.sample` call through the paged engine (one prefill per prompt shared by its
samples, continuous batching over `max_num_seqs` decode slots, prefix cache on, XLA blocked paged
attention). A first run with other prompts of the same shapes compiles every program; the second run is
timed: tokens/s = generated tokens / its wall time.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from step_decode import generated_tokens, sample_batch, sample_compiles
from suite import jax_step

MODEL = "qwen3_1p7b"


def main() -> None:
    args, device, results, w, m = jax_step("e", __doc__, "rl", MODEL)
    with results.workload("rl_sample") as row:
        import tx
        from tx import types

        n, k, plen, (lo, hi), rank = w["prompts"], w["samples"], w["prompt_len"], w["max_tokens"], w["rank"]
        rng = np.random.default_rng(0)
        max_tokens = rng.integers(lo, hi + 1, n).tolist()
        expected = k * sum(max_tokens)
        row["shapes"] = {"model": MODEL, **vars(m), "prompts": n, "samples": k, "prompt_len": plen,
                         "max_tokens": [lo, hi], "rank": rank, "dtype": "bfloat16", "engine": "paged",
                         "paged_attention_impl": "blocked", "max_num_seqs": w["max_num_seqs"],
                         "generated_tokens": expected}
        backend = tx.JaxBackend(str(Path(args.models) / MODEL), tx.JaxBackendConfig(
            max_lora_adapters=2, max_lora_rank=rank, max_seq_len=plen + hi + 1, max_num_samples=k,
            paged_attention_impl="blocked", max_num_seqs=w["max_num_seqs"]))
        backend.create_model("m0", types.LoraConfig(rank=rank, alpha=2.0 * rank, seed=0))
        warm = rng.integers(3, m.vocab_size, (n, plen)).tolist()
        start = time.perf_counter()
        generated_tokens(backend.sample(sample_batch(warm, max_tokens, "m0", samples=k, temperature=1.0)))
        row["warmup_s"] = round(time.perf_counter() - start, 3)
        before, stats_before = sample_compiles(backend), dict(backend.metrics.sampling)
        prompts = rng.integers(3, m.vocab_size, (n, plen)).tolist()  # new to the prefix cache, as a new RL step's
        start = time.perf_counter()
        got = generated_tokens(backend.sample(sample_batch(prompts, max_tokens, "m0", samples=k, temperature=1.0)))
        elapsed = time.perf_counter() - start
        if got != expected:
            raise RuntimeError(f"generated {got} tokens, expected {expected}")
        stats = backend.metrics.sampling
        row.update({
            "tokens_per_s": round(got / elapsed, 1), "total_s": round(elapsed, 4),
            "step_time_s": None,  # no fixed step: rows join and leave between calls
            "compiles": sample_compiles(backend), "compiles_during_timing": sample_compiles(backend) - before,
            "prefill_tokens_computed": stats.get("prefill_tokens", 0) - stats_before.get("prefill_tokens", 0),
            "preempted": stats.get("preempted", 0) - stats_before.get("preempted", 0),
            "engine_calls": stats.get("calls", 0) - stats_before.get("calls", 0),
            "kv_cache_pages": stats.get("kv_cache_pages"), "peak_pages": stats.get("peak_pages"),
        })


if __name__ == "__main__":
    main()
