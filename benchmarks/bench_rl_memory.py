"""Resident memory of tx over the steps of an RL loop: bench_peer's `sample_rl` sampling (prompts x samples,
max_tokens drawn per prompt, T = 1, a decode slot per row, new prompts every step) with, between two samplings,
a forward_backward of `--train-rows` rows and an optim_step of the adapter that sampled, as an RL step changes
the weights it samples with.

    .venv-peer/bin/python benchmarks/bench_rl_memory.py                          # ~100M Qwen3, 4 steps
    .venv-peer/bin/python benchmarks/bench_rl_memory.py --tx-source /tmp/tx-old  # an older commit's tx

One process (the steps share it, as a server's do). A JSON line per step: the sampling's seconds and tokens/s
(the first step compiles), the resident memory after it and the process's peak so far (VmHWM), the KV pages
in use at most and the cached pages the weight changes freed so far; then a summary line with the model
shapes, the peak, jax and the device.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_peer import TxEngine, peak_rss_mb, source_commit, use_tx_source, workload_shapes, write_checkpoint
from common import add_model_args


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def run(args: argparse.Namespace, model_dir: str) -> None:
    if args.tx_source:
        use_tx_source(args.tx_source)
    import logging

    import jax
    import tx

    n, k, plen = args.rl_prompts, args.rl_samples, args.rl_prompt_len
    config = {"max_num_seqs": n * k} | json.loads(args.tx_config)  # a decode slot per row, as bench_peer's
    engine = TxEngine(model_dir, 1, plen + args.rl_max_tokens[1] + 1, config)
    logging.getLogger("tx").setLevel(logging.WARNING)
    stats = engine.backend.metrics.sampling
    rng = np.random.default_rng(0)
    max_tokens = rng.integers(args.rl_max_tokens[0], args.rl_max_tokens[1] + 1, n).tolist()
    for step in range(args.steps):
        batch = engine.sample_batch(rng.integers(3, args.vocab_size, (n, plen)).tolist(), k, max_tokens, 1.0)
        start = time.perf_counter()
        engine.backend.sample(batch)
        took = time.perf_counter() - start
        print(json.dumps({"step": step, "sample_s": round(took, 2),
                          "tokens_per_s": round(k * sum(max_tokens) / took, 1), "rss_mb": round(rss_mb()),
                          "peak_rss_mb": round(peak_rss_mb()),
                          "peak_pages": stats["peak_pages"], "pages_uncached": stats.get("pages_uncached")}),
              flush=True)
        rows = rng.integers(3, args.vocab_size, (args.train_rows, plen + 1)).tolist()
        engine.backend.forward_backward(engine.pass_batch(rows, [0] * args.train_rows))
        engine.optim_step("m0")
    dev = jax.devices()[0]
    shapes = workload_shapes("sample_rl", args) | {"steps": args.steps, "train_rows": args.train_rows}
    print(json.dumps({"workload": "rl_loop_memory", "shapes": shapes, "peak_rss_mb": round(peak_rss_mb()),
                      "kv_cache_pages": stats["kv_cache_pages"], "jax": jax.__version__,
                      "device": f"{dev.platform}:{dev.device_kind}",
                      "tx_commit": source_commit(str(Path(tx.__file__).parent)) or args.tx_source}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, hidden=768, layers=8, heads=12, kv_heads=4, intermediate=2048, head_dim=64)
    parser.add_argument("--steps", type=int, default=4, help="samplings (a training step between two)")
    parser.add_argument("--train-rows", type=int, default=8, help="rows of each forward_backward")
    parser.add_argument("--rl-prompts", type=int, default=32)
    parser.add_argument("--rl-samples", type=int, default=16)
    parser.add_argument("--rl-prompt-len", type=int, default=128)
    parser.add_argument("--rl-max-tokens", type=int, nargs=2, default=[16, 256])
    parser.add_argument("--tx-config", default="{}", help="JSON of tx JaxBackendConfig fields to override")
    parser.add_argument("--tx-source", help="run tx from this folder (`git archive <rev> tx | tar -x -C DIR`)")
    parser.add_argument("--model-dir", help="a checkpoint bench_peer wrote (default: write one to a temporary folder)")
    args = parser.parse_args()
    if args.model_dir:
        return run(args, args.model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), args)
        run(args, tmp)


if __name__ == "__main__":
    main()
