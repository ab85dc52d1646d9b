"""Step d: decode throughput at batch 1, 64 and 256 (Qwen3-1.7B shape, bf16) through tx's paged sampling engine.

One JaxBackend, paged_attention_impl="blocked" (XLA online softmax over KV
blocks: the Pallas kernel is TPU-only), `max_num_seqs` = the largest batch, prefix cache off (so a repeated
measurement prefills again), one LoRA adapter of rank `rank` read by every row. Per batch B: B prompts of
`prompt_len` random tokens, greedy, no stop tokens, so every row generates `new_tokens`. As in
benchmarks/bench_sample.py, prefill time is that of a 1-token generation and decode time is total - prefill:
decode tokens/s = B (new_tokens - 1) / (total - prefill), `step_time_s` = one decode step. One warm-up
(compiling) round with other prompts first; medians of `repeats`.

Then the default config with `paged_async_dispatch` off (every decode call waits for the host to read the one
before) at `sync_batches`, on the same backend (so the same programs and the same call lengths: only the
dispatch differs), as `decode_sync_b<B>` (with `greedy_vs_default`); each line
counts the calls dispatched from the device's state (`chained_calls`). Then `paged_decode_layers="scan"` (the
layer scan, which copies every layer's weights out of the stack at every step, where "auto" now runs the
layers one by one on per-layer copies of their weights on one GPU) at `scan_batches`, as `decode_scan_b<B>`;
those lines also compare both configs' greedy tokens and log-probs on `check_rows` fixed prompts
(`greedy_vs_default`).

`hbm_fraction`: suite.decode_step_bytes (every matmul weight in bf16, one adapter's LoRA weights in float32,
each row's K/V over the mean context) / step time / the device's HBM bandwidth (METHOD.md).
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import numpy as np

from suite import decode_step_bytes, jax_step

MODEL = "qwen3_1p7b"


def sample_batch(prompts: list[list[int]], max_tokens: list[int], model_id: str, samples: int = 1,
                 temperature: float = 0.0):
    """One request per prompt, `samples` rows each; request i's rows use seed i (stop lists empty)."""
    from tx import types

    n = len(prompts)
    params = [types.SamplingParams(max_tokens=mt, temperature=temperature, seed=i, stop=[])
              for i, mt in enumerate(max_tokens) for _ in range(samples)]
    return types.PreparedSampleBatch(
        all_prompts=[p for p in prompts for _ in range(samples)], all_sampling_params=params,
        all_model_ids=[model_id] * n * samples, all_checkpoint_ids=[""] * n * samples,
        all_checkpoint_paths=[""] * n * samples,
        request_batch_slices=[(f"r{i}", model_id, i * samples, (i + 1) * samples, False, 0) for i in range(n)])


def generated_tokens(out: dict) -> int:
    from tx import types

    bad = [o for o in out.values() if not isinstance(o, types.SampleOutput)]
    if bad:
        raise RuntimeError(f"sample failed: {bad[0]}")
    return sum(len(s.tokens) for o in out.values() for s in o.sequences)


def sample_compiles(backend) -> int:
    return sum(v for k, v in backend.metrics.compiles.items() if k.startswith("sample"))


def greedy_rows(backend, m, plen: int, rows: int, tokens: int) -> list[tuple[list[int], list[float]]]:
    """(tokens, log-probs) of `rows` fixed prompts (seeded), greedy through adapter m0: what two configs compare."""
    prompts = np.random.default_rng(1).integers(3, m.vocab_size, (rows, plen)).tolist()
    out = backend.sample(sample_batch(prompts, [tokens] * rows, "m0"))
    generated_tokens(out)  # raises on a failed request
    return [(out[f"r{i}"].sequences[0].tokens, out[f"r{i}"].sequences[0].logprobs) for i in range(rows)]


def compare_greedy(want: list, got: list) -> dict:
    """Where two configs' greedy rows first differ, and their largest log-prob gap before that (bf16 sums in
    another order flip near-ties of a random model's logits; a bug shows as a gap far above bf16's)."""
    first, gaps = [], []
    for (ta, la), (tb, lb) in zip(want, got, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        first.append(n)
        upto = len(ta) if n is None else n
        gaps.append(float(np.max(np.abs(np.asarray(la[:upto]) - np.asarray(lb[:upto])))) if upto else 0.0)
    return {"rows": len(want), "identical_rows": first.count(None), "first_difference": first,
            "max_logprob_gap_before_difference": round(max(gaps), 5)}


def main() -> None:
    args, device, results, w, m = jax_step("d", __doc__, "decode", MODEL)
    plen, new, rank = w["prompt_len"], w["new_tokens"], w["rank"]
    check_rows, check_tokens = w["check_rows"], w["check_tokens"]
    rng = np.random.default_rng(0)
    default_rows = None
    # the default config ("auto": the layers unrolled on per-layer weight copies on one GPU), then the layer scan
    for variant, batches, extra in (("", w["batches"], {}),
                                    ("scan_", w["scan_batches"], {"paged_decode_layers": "scan"})):
        backend, error = None, None
        try:
            import tx
            from tx import types

            backend = tx.JaxBackend(str(Path(args.models) / MODEL), tx.JaxBackendConfig(
                max_lora_adapters=2, max_lora_rank=rank, max_seq_len=plen + new + 1,
                paged_attention_impl="blocked", max_num_seqs=max(w["batches"]), prefix_cache=False, **extra))
            backend.create_model("m0", types.LoraConfig(rank=rank, alpha=2.0 * rank, seed=0))
            rows = greedy_rows(backend, m, plen, check_rows, check_tokens)
            default_rows = default_rows or rows
        except Exception as exc:  # noqa: BLE001 - every workload reports it
            error = exc
        # the default config also without async dispatch, on the same backend (the same programs)
        sync = [("sync_", b) for b in w["sync_batches"]] if not variant else []
        for name, batch in [(variant, b) for b in batches] + sync:
            with results.workload(f"decode_{name}b{batch}") as row:
                if error is not None:
                    raise RuntimeError(f"backend setup failed: {type(error).__name__}: {error}")
                paged = backend.sampler.paged
                paged.async_dispatch = name != "sync_" and backend.config.paged_async_dispatch
                row["shapes"] = {"model": MODEL, **vars(m), "batch": batch, "prompt_len": plen, "new_tokens": new,
                                 "rank": rank, "adapters": 1, "dtype": "bfloat16", "engine": "paged",
                                 "paged_attention_impl": "blocked", "max_num_seqs": backend.config.max_num_seqs,
                                 "decode_steps_per_call": backend.config.decode_steps_per_call,
                                 "max_decode_steps_per_call": backend.config.max_decode_steps_per_call,
                                 "decode_layers": "unrolled" if paged.device.unrolled else "scan",
                                 "paged_async_dispatch": paged.async_dispatch}
                chained = backend.metrics.sampling.get("chained_calls", 0)
                row.update(measure(backend, device, m, rng, batch, plen, new, rank, w["repeats"]))
                row["chained_calls"] = backend.metrics.sampling.get("chained_calls", 0) - chained
                if name:
                    got = rows if variant else greedy_rows(backend, m, plen, check_rows, check_tokens)
                    row["greedy_vs_default"] = compare_greedy(default_rows, got)
        del backend  # its weights, copies and KV pool leave the device before the next variant's
        gc.collect()


def measure(backend, device, m, rng, batch: int, plen: int, new: int, rank: int, repeats: int) -> dict:
    """Prefill and decode timing of `batch` random prompts (one compiling round first)."""

    def run(tokens: int) -> float:
        prompts = rng.integers(3, m.vocab_size, (batch, plen)).tolist()
        start = time.perf_counter()
        got = generated_tokens(backend.sample(sample_batch(prompts, [tokens] * batch, "m0")))
        elapsed = time.perf_counter() - start
        if got != batch * tokens:
            raise RuntimeError(f"generated {got} tokens, expected {batch * tokens}")
        return elapsed

    run(1), run(new)  # compile every program this batch uses
    before = sample_compiles(backend)
    prefill = statistics.median(run(1) for _ in range(repeats))
    total = statistics.median(run(new) for _ in range(repeats))
    decode = total - prefill
    step = decode / max(new - 1, 1) if decode > 0 else None  # None: lost in the noise (tiny shapes)
    bytes_per_step = decode_step_bytes(m, rank, batch, plen + new / 2)
    return {
        "step_time_s": step and round(step, 6), "tokens_per_s": step and round(batch / step, 1),
        "prefill_s": round(prefill, 5), "prefill_tokens_per_s": round(batch * plen / prefill, 1),
        "total_s": round(total, 5),
        "compiles": sample_compiles(backend), "compiles_during_timing": sample_compiles(backend) - before,
        "bytes_per_decode_step": int(bytes_per_step),
        "hbm_fraction": (round(bytes_per_step / step / device.peak_bandwidth, 4)
                         if device.peak_bandwidth and step else None),
        "peak_hbm_tb_per_s": device.peak_bandwidth and device.peak_bandwidth / 1e12,
        "kv_cache_pages": backend.metrics.sampling.get("kv_cache_pages"),
    }

if __name__ == "__main__":
    main()
