"""Where a paged-engine decode step spends its time: one process, a profiler trace per batch, summarised.

    python benchmarks/device/profile_decode.py --models DIR --out DIR [--model qwen3_0p6b] [--tag T] [--config JSON]
        [--dry-run]

Writes the checkpoint (`setup_models.write`) if DIR lacks it, builds the suite's decode backend (step d's
config), warms each batch up, times `--new` greedy tokens at batch B, then traces one more such call with
`jax.profiler.trace(create_perfetto_trace=True)` and summarises the trace into `profile.jsonl`: device time by
kernel name (top 25), the number of kernels per decode step, the device's busy fraction of the call, and the
host time of the engine's Python functions. A diagnostic, not a measurement the suite reports.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import statistics
import time
import zlib
from pathlib import Path

from setup_models import write
from step_decode import generated_tokens, sample_batch
from suite import MODELS


def busy_time(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) spans (microseconds)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarise(trace_dir: Path, steps: int) -> dict:
    path = next(trace_dir.rglob("perfetto_trace.json.gz"))
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, n in names.items() if "gpu" in n.lower() or "device" in n.lower()}
    spans = [e for e in events if e.get("ph") == "X"]
    device = [e for e in spans if e["pid"] in device_pids]
    host = [e for e in spans if e["pid"] not in device_pids]
    out: dict = {"trace_mb": round(path.stat().st_size / 2**20, 2), "processes": sorted(set(names.values()))}
    if device:
        by_name = collections.defaultdict(lambda: [0.0, 0])
        for e in device:
            by_name[e["name"]][0] += e["dur"]
            by_name[e["name"]][1] += 1
        first, last = min(e["ts"] for e in device), max(e["ts"] + e["dur"] for e in device)
        out.update({
            "device_events": len(device), "device_events_per_step": round(len(device) / steps, 1),
            "device_window_ms": round((last - first) / 1e3, 3),
            "device_busy_ms": round(busy_time([(e["ts"], e["ts"] + e["dur"]) for e in device]) / 1e3, 3),
            "top_device": [(n[:120], round(t / 1e3, 3), c) for n, (t, c) in
                           sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]],
        })
    wanted = ("decode", "prefill", "_slot_arrays", "_put", "to_host", "_run", "step", "sample", "block_until")
    host_by = collections.defaultdict(float)
    for e in host:
        if any(w in e["name"] for w in wanted):
            host_by[e["name"][:100]] += e["dur"]
    out["host_ms"] = sorted(((n, round(t / 1e3, 3)) for n, t in host_by.items()), key=lambda x: -x[1])[:25]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3_0p6b")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--steps-per-call", type=int, default=8)
    p.add_argument("--tag", default="", help="names this variant's traces (e.g. the XLA flags tried)")
    p.add_argument("--config", default="{}", help="JSON: JaxBackendConfig fields over the suite's decode config, "
                   "e.g. '{\"paged_decode_layers\": \"unrolled\"}'")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    import jax
    import numpy as np

    import tx
    from tx import types

    if jax.default_backend() == "cpu" and not args.dry_run:
        raise SystemExit(f"profile_decode: JAX runs on {jax.devices()[0]}, not an accelerator (JAX_PLATFORMS="
                         f"{os.environ.get('JAX_PLATFORMS')!r}); --dry-run profiles the CPU on purpose")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "profile.jsonl", "a")

    def emit(row: dict) -> None:
        row = {"tag": args.tag, "config": json.loads(args.config), "steps_per_call": args.steps_per_call, "model": args.model, "jax": jax.__version__,
               "device": jax.devices()[0].device_kind, "xla_flags": os.environ.get("XLA_FLAGS", ""), **row}
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()

    shape = MODELS["dry" if args.dry_run else "full"][args.model]
    start = time.perf_counter()
    path, _, reused = write(str(Path(args.models) / args.model), shape)
    emit({"what": "checkpoint", "s": round(time.perf_counter() - start, 1), "reused": reused})
    batches = [int(b) for b in args.batches.split(",")]
    plen, rank = 128 if not args.dry_run else 8, 32 if not args.dry_run else 4
    backend = tx.JaxBackend(path, tx.JaxBackendConfig(
        max_lora_adapters=2, max_lora_rank=rank, max_seq_len=plen + args.new + 1,
        paged_attention_impl="blocked", max_num_seqs=max(batches), prefix_cache=False,
        decode_steps_per_call=args.steps_per_call, **json.loads(args.config)))
    backend.create_model("m0", types.LoraConfig(rank=rank, alpha=2.0 * rank, seed=0))
    rng = np.random.default_rng(0)
    for b in batches:
        last: dict = {}

        def run(tokens: int) -> float:
            prompts = rng.integers(3, shape["vocab_size"], (b, plen)).tolist()
            t0 = time.perf_counter()
            last["out"] = backend.sample(sample_batch(prompts, [tokens] * b, "m0"))
            got = generated_tokens(last["out"])
            assert got == b * tokens, (got, b * tokens)
            return time.perf_counter() - t0

        run(1), run(args.new)
        prefill = statistics.median(run(1) for _ in range(3))
        total = statistics.median(run(args.new) for _ in range(3))
        step_ms = (total - prefill) / (args.new - 1) * 1e3
        trace_dir = out / f"trace_b{b}_k{args.steps_per_call}{'_' + args.tag if args.tag else ''}"
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            traced = run(args.new)
        # the same seeded prompts in every variant: equal checksums = the same greedy tokens
        tokens = [s.tokens for _, o in sorted(last["out"].items()) for s in o.sequences]
        crc = zlib.crc32(json.dumps(tokens).encode())
        try:
            summary = summarise(trace_dir, args.new)
        except Exception as exc:  # the timings above still count; the raw trace stays for reading by hand
            summary = {"summary_error": f"{type(exc).__name__}: {exc}"[:300]}
        emit({"what": "decode", "batch": b, "new": args.new, "prefill_ms": round(prefill * 1e3, 2),
              "total_ms": round(total * 1e3, 2), "step_ms": round(step_ms, 3), "traced_total_ms": round(traced * 1e3, 2),
              "tokens_per_s": round(b / step_ms * 1e3, 1), "tokens_crc32": crc, **summary})
        for f in trace_dir.rglob("*"):
            if f.is_file() and not f.name.startswith("perfetto"):
                f.unlink()  # keep only the perfetto trace (the xplane is large)


if __name__ == "__main__":
    main()
