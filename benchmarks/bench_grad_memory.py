"""Memory of the passes that touch the gradient sums (issue 12 #19), from XLA's compiled memory analysis.

    python benchmarks/bench_grad_memory.py            # Qwen3-0.6B layer shape, 2 layers, rank 32, 32 slots
    python benchmarks/bench_grad_memory.py --num-layers 1 --vocab-size 32000 --slots 8   # quick

The model is a random checkpoint of the given shape (defaults: hidden 1024, 16 query / 8 KV heads of
128, intermediate 3072, vocab 151936, tied embeddings). Every slot holds an adapter of rank `--rank`.
The script runs forward and forward_backward once through the backend, captures each jitted call the
backend made with its real arguments, and prints one JSON line per call with the compiled sizes
(arguments, outputs, temporaries, bytes aliased to donated inputs) and `peak` = arguments + outputs +
temporaries - aliased, next to the size of the gradient sums. It also prints the peak RSS of the process
during one forward call. It uses only the backend's public calls and `_run`, so it runs unchanged on
older trees (to measure "before").
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from common import PeakRSS, add_model_args, model_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=1024, layers=2, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
                   vocab=151936)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--slots", type=int, default=32, help="adapter slots including slot 0 (the base model)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()

    import jax

    import tx
    from tx import types
    from tx.models.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "model", model_spec(args, tie_word_embeddings=True))
        config = tx.JaxBackendConfig(max_lora_adapters=args.slots, max_lora_rank=args.rank, loss_chunk_size=256)
        backend = tx.JaxBackend(str(model_dir), config)
        models = [f"m{i}" for i in range(1, args.slots)]
        for m in models:
            backend.create_model(m, types.LoraConfig(rank=args.rank, seed=1))
    grad_bytes = sum(x.nbytes for x in jax.tree.leaves(backend._grad_sum))

    rng = np.random.default_rng(0)
    n = args.seq_len
    datums = [rng.integers(0, args.vocab_size, n + 1) for _ in range(args.rows)]
    batch = types.PreparedModelPassBatch(
        all_input_ids=[d[:-1].tolist() for d in datums], all_targets=[d[1:].tolist() for d in datums],
        all_token_weights=[[1.0] * n] * args.rows, all_sampling_logprobs=[[]] * args.rows,
        all_advantages=[[]] * args.rows, all_model_ids=[models[i % len(models)] for i in range(args.rows)],
        all_loss_fns=["cross_entropy"] * args.rows, all_loss_fn_configs=[None] * args.rows,
        request_batch_slices=[(f"r{i}", models[i % len(models)], i, i + 1) for i in range(args.rows)],
    )

    captured: list[tuple[str, object, tuple]] = []
    real_run = backend.runtime.run

    def capturing_run(name, fn, *call_args):
        # donated arguments are gone after the call: lower against their shapes and shardings
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                              if isinstance(x, jax.Array) else x, call_args)
        captured.append((name, fn, shapes))
        return real_run(name, fn, *call_args)

    backend.runtime.run = capturing_run
    backend.forward(batch)  # compile outside the measured call
    import psutil

    start_rss = psutil.Process().memory_info().rss
    with PeakRSS() as rss_peak:
        t0 = time.perf_counter()
        backend.forward(batch)
        seconds = time.perf_counter() - t0
    rss = rss_peak.peak - start_rss
    backend.forward_backward(batch)
    print(json.dumps({"shape": vars(args), "grad_sum_bytes": grad_bytes, "forward_seconds": round(seconds, 3),
                      "forward_peak_rss_above_start_bytes": rss}))
    seen = set()
    for name, fn, shapes in captured:
        key = (name, id(fn))
        if key in seen:
            continue
        seen.add(key)
        mem = fn.lower(*shapes).compile().memory_analysis()
        sizes = {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
        peak = sizes["argument"] + sizes["output"] + sizes["temp"] - sizes["alias"]
        print(json.dumps({"call": name, "args": len(shapes), **sizes, "peak": peak,
                          "peak_over_grad_sum": round(peak / grad_bytes, 3)}))


if __name__ == "__main__":
    main()
