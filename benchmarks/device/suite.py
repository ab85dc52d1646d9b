"""What every step of the device suite shares: shapes, peaks, FLOP and byte counts, timing, JSON lines.

Each step (step_*.py) is its own process (so `peak_bytes_in_use` of the device is that step's own peak)
and appends one JSON line per workload to the results file as soon as the workload finishes. Every line
has `COMMON_KEYS` (None where a value does not apply or is unknown, e.g. device memory on CPU) plus the
step's own keys; a workload that fails writes the same keys with `error` set, and the suite goes on.

    python benchmarks/device/suite.py fail --results R --step b --message "exit 124" [--log LOG] [--dry-run]

writes an error line for each workload of a step that did not write its own (run.sh: timeouts, crashes).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: common.py

COMMON_KEYS = ("suite", "step", "workload", "framework", "dry_run", "device", "platform", "jax_version", "shapes",
               "tokens_per_s", "step_time_s", "compiles", "mfu", "peak_bytes_in_use", "host_max_rss_bytes",
               "elapsed_s", "error")


def lora_workload(adapters: int) -> str:
    return "lora_train_1_adapter" if adapters == 1 else f"lora_train_{adapters}_adapters"


def lora_shapes(model: str, m, w: dict, adapters: int, **extra) -> dict:
    """The `shapes` of a LoRA training line (tx's and PyTorch's alike)."""
    return {"model": model, **vars(m), "rows": w["rows"], "seq_len": w["seq_len"],
            "tokens_per_step": w["rows"] * w["seq_len"], "adapters": adapters, "rank": w["rank"],
            "dtype": "bfloat16", "gradient_checkpointing": False, **extra}


def step_workloads(dry: bool) -> dict[str, list[str]]:
    """The workloads each step writes, in order (run.sh and the test check that each wrote its line)."""
    w = WORK["dry" if dry else "full"]
    lora = [lora_workload(1), lora_workload(w["lora"]["adapters"])]
    return {
        "setup": ["setup_models"],
        "a": ["attention_parity_unpacked", "attention_parity_packed", f"attention_time_t{w['attention']['time_len']}"],
        "b": lora,
        "c": ["full_train"],
        "d": ([f"decode_b{b}" for b in w["decode"]["batches"]]
              + [f"decode_sync_b{b}" for b in w["decode"]["sync_batches"]]
              + [f"decode_scan_b{b}" for b in w["decode"]["scan_batches"]]),
        "e": ["rl_sample"],
        "g": lora + [f"decode_b{b}" for b in w["decode"]["torch_batches"]],
    }


STEP_FRAMEWORK = {"g": "torch+peft"}

# Qwen3 shapes (tied embeddings, as the released 0.6B and 1.7B); the dry run's tiny stand-ins keep the
# code paths (GQA, tied head, several layers) at sizes a 2-core CPU runs in seconds.
MODELS = {
    "full": {
        "qwen3_1p7b": dict(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                           intermediate_size=6144, vocab_size=151936),
        "qwen3_0p6b": dict(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                           intermediate_size=3072, vocab_size=151936),
    },
    "dry": {
        "qwen3_1p7b": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                           intermediate_size=128, vocab_size=512),
        "qwen3_0p6b": dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                           intermediate_size=96, vocab_size=512),
    },
}
# Per-step workload sizes. `steps`: timed repetitions (median reported), after `warmup` untimed ones.
WORK = {
    "full": {
        "attention": dict(batch=2, parity_len=2048, time_batch=4, time_len=4096, heads=16, kv_heads=8, head_dim=128,
                          repeats=10, tolerance=2e-2),
        "lora": dict(rows=8, seq_len=512, rank=32, adapters=8, steps=5, warmup=1),
        "full": dict(rows=4, seq_len=1024, steps=4, warmup=1),
        "decode": dict(batches=[1, 64, 256], torch_batches=[1, 64], prompt_len=128, new_tokens=128, rank=32,
                       repeats=2, scan_batches=[1], sync_batches=[1], check_rows=8, check_tokens=64),
        "rl": dict(prompts=32, samples=16, prompt_len=512, max_tokens=[16, 256], rank=32, max_num_seqs=256),
    },
    "dry": {
        "attention": dict(batch=2, parity_len=64, time_batch=2, time_len=128, heads=4, kv_heads=2, head_dim=16,
                          repeats=2, tolerance=2e-2),
        "lora": dict(rows=8, seq_len=16, rank=4, adapters=8, steps=2, warmup=1),
        "full": dict(rows=4, seq_len=16, steps=2, warmup=1),
        "decode": dict(batches=[1, 2, 4], torch_batches=[1, 2], prompt_len=8, new_tokens=8, rank=4, repeats=1,
                       scan_batches=[1], sync_batches=[1], check_rows=2, check_tokens=8),
        # one max_tokens: every row ends in the same call, so one decode program (CPU compiles are slow)
        "rl": dict(prompts=4, samples=4, prompt_len=8, max_tokens=[8, 8], rank=4, max_num_seqs=16),
    },
}

# Dense bf16 tensor-core peak (FLOP/s, no sparsity) and HBM bandwidth (bytes/s) by device_kind substring,
# most specific first. H100 SXM and H200 share the compute peak; H200 has faster, larger HBM (HBM3e).
PEAKS = (
    ("H200", 989.4e12, 4.8e12),
    ("H100 PCIe", 756.0e12, 2.0e12),
    ("H100 NVL", 835.0e12, 3.9e12),
    ("H100", 989.4e12, 3.35e12),  # SXM5 (device_kind "NVIDIA H100 80GB HBM3")
    ("A100", 312.0e12, 2.039e12),
)


def peaks(device_kind: str) -> tuple[float | None, float | None]:
    """(bf16 FLOP/s, HBM bytes/s) of a device kind; (None, None) where unknown (CPU: no MFU is claimed)."""
    for name, flops, bandwidth in PEAKS:
        if name.lower() in device_kind.lower():
            return flops, bandwidth
    return None, None


def model_shape(dry: bool, name: str) -> SimpleNamespace:
    return SimpleNamespace(**MODELS["dry" if dry else "full"][name])


def work(dry: bool, name: str) -> dict:
    return dict(WORK["dry" if dry else "full"][name])


# ---- FLOP and byte counts (METHOD.md explains them) ----

def linear_shapes(m) -> list[tuple[int, int]]:
    """(in, out) of every matmul weight a token passes through: 7 per layer, and the LM head."""
    d, q, kv, ff = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.intermediate_size
    layer = [(d, q), (d, kv), (d, kv), (q, d), (d, ff), (d, ff), (ff, d)]
    return layer * m.num_layers + [(d, m.vocab_size)]


def matmul_params(m) -> int:
    """N: weights multiplied per token (every linear layer and the LM head; the embedding lookup is free)."""
    return sum(i * o for i, o in linear_shapes(m))


def lora_params(m, rank: int) -> int:
    """LoRA weights of one adapter on every linear layer and the LM head: rank x (in + out) each."""
    return sum(rank * (i + o) for i, o in linear_shapes(m))


def attention_flops_per_token(m, seq_len: int) -> float:
    """Causal attention forward FLOPs per token, averaged over a row of `seq_len` (visible keys only):
    QK^T and PV are 2 * head_dim FLOPs per (head, key), so 4 * h * d * i at position i, 2 * h * d * t mean."""
    return 2.0 * m.num_layers * m.num_heads * m.head_dim * seq_len


def lora_train_flops(m, rank: int, tokens: int, seq_len: int) -> float:
    """forward_backward with frozen base weights: base forward 2N + input gradients 2N (no weight gradients),
    LoRA forward 2N_lora + input and weight gradients 4N_lora, attention forward + 2x for its backward."""
    return tokens * (4 * matmul_params(m) + 6 * lora_params(m, rank) + 3 * attention_flops_per_token(m, seq_len))


def full_train_flops(m, tokens: int, seq_len: int) -> float:
    """Full fine-tuning: 6N (forward, input and weight gradients) + attention forward and backward."""
    return tokens * (6 * matmul_params(m) + 3 * attention_flops_per_token(m, seq_len))


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    return None if peak is None or seconds <= 0 else round(flops / seconds / peak, 4)


def kv_bytes_per_token(m, dtype_bytes: int = 2) -> int:
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * dtype_bytes


def decode_step_bytes(m, rank: int, batch: int, context: float, weight_bytes: int = 2) -> float:
    """HBM bytes one decode step must read at least: every matmul weight once (bf16), one adapter's LoRA
    weights (float32), and each row's K/V cache over `context` positions."""
    return matmul_params(m) * weight_bytes + lora_params(m, rank) * 4 + batch * context * kv_bytes_per_token(m)


# ---- timing ----

def median_time(fn: Callable[[], object], repeats: int, sync: Callable[[object], object] = lambda x: x) -> float:
    """Median wall seconds of `repeats` calls of `fn` (each result passed through `sync`, e.g.
    jax.block_until_ready or torch.cuda.synchronize, before the clock stops)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- the process's device, and its JSON lines ----

def jax_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jax")
    except PackageNotFoundError:
        return None


def host_max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Device:
    """What a line says about where it ran: `jax` (device kind, platform, peak device memory since this
    process started) or `torch` (CUDA device name, peak allocated bytes since the last `reset_peak`)."""

    def __init__(self, kind: str = "jax"):
        self.kind = kind
        if kind == "jax":
            import jax

            dev = jax.devices()[0]
            self.name, self.platform = dev.device_kind, dev.platform
        else:
            import torch

            self.cuda = torch.cuda.is_available()
            self.name = torch.cuda.get_device_name(0) if self.cuda else "cpu"
            self.platform = "cuda" if self.cuda else "cpu"
        self.peak_flops, self.peak_bandwidth = peaks(self.name)

    def peak_bytes(self) -> int | None:
        if self.kind == "jax":
            import jax

            stats = jax.devices()[0].memory_stats() or {}
            return stats.get("peak_bytes_in_use")
        if self.cuda:
            import torch

            return int(torch.cuda.max_memory_allocated())
        return None

    def reset_peak(self) -> None:
        if self.kind == "torch" and self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()

    def sync(self, value=None):
        """Wait for the device: block_until_ready (jax) / cuda.synchronize (torch)."""
        if self.kind == "jax":
            import jax

            return jax.block_until_ready(value)
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return value


class Results:
    """Appends a step's JSON lines to the results file (one open-append-close per line)."""

    def __init__(self, path: str | Path, step: str, dry_run: bool, device: Device | None):
        self.path, self.step, self.dry_run, self.device = Path(path), step, dry_run, device

    def base(self, workload: str) -> dict:
        dev = self.device
        return {"suite": "tx-device", "step": self.step, "workload": workload,
                "framework": STEP_FRAMEWORK.get(self.step, "tx"), "dry_run": self.dry_run,
                "device": dev.name if dev else None, "platform": dev.platform if dev else None,
                "jax_version": jax_version(), "shapes": None, "tokens_per_s": None, "step_time_s": None,
                "compiles": None, "mfu": None, "peak_bytes_in_use": None, "host_max_rss_bytes": None,
                "elapsed_s": None, "error": None}

    def write(self, row: dict, echo: bool = True) -> dict:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if echo:  # into the step's log; run.sh shows the results file's new lines itself
            print(json.dumps(row), flush=True)
        return row

    @contextmanager
    def workload(self, name: str):
        """Yields the line's dict to fill; writes it when the block ends, with `error` set if it raised
        (the exception is not re-raised: the step goes on with its next workload)."""
        row = self.base(name)
        start = time.perf_counter()
        if self.device:
            self.device.reset_peak()
        try:
            yield row
        except Exception as exc:  # noqa: BLE001 - recorded in the line, the suite goes on
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            row["traceback_tail"] = traceback.format_exc()[-3000:]
        row["elapsed_s"] = round(time.perf_counter() - start, 3)
        row["peak_bytes_in_use"] = self.device.peak_bytes() if self.device else None
        row["host_max_rss_bytes"] = host_max_rss()
        self.write(row)


def step_args(step: str, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--results", required=True, help="JSON-lines file to append to")
    parser.add_argument("--models", required=True, help="folder of the random checkpoints (setup_models.py)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU)")
    args = parser.parse_args()
    args.step = step
    return args


def written(results: Path, step: str) -> set[str]:
    """Workloads of `step` that already have a line in `results`."""
    if not results.exists():
        return set()
    done = set()
    for line in results.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step") == step:
            done.add(row.get("workload"))
    return done


def fail_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="suite.py fail")
    parser.add_argument("--results", required=True)
    parser.add_argument("--step", required=True)
    parser.add_argument("--message", required=True)
    parser.add_argument("--log", default=None)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    results = Path(args.results)
    out = Results(results, args.step, args.dry_run, None)
    tail = Path(args.log).read_text(errors="replace")[-3000:] if args.log and Path(args.log).exists() else ""
    for workload in step_workloads(args.dry_run)[args.step]:
        if workload not in written(results, args.step):
            out.write(out.base(workload) | {"error": args.message, "log_tail": tail}, echo=False)


if __name__ == "__main__":
    if sys.argv[1:2] == ["fail"]:
        fail_main(sys.argv[2:])
    else:
        raise SystemExit(__doc__)


def jax_step(step: str, doc: str, work_name: str, model: str | None = None):
    """What every tx step starts with: its arguments, the JAX device, its results file, its workload sizes
    and (given `model`) the model's shape: `(args, device, results, w, m)`."""
    args = step_args(step, doc.split("\n\n")[0])
    device = Device("jax")
    results = Results(args.results, step, args.dry_run, device)
    m = model_shape(args.dry_run, model) if model else None
    return args, device, results, work(args.dry_run, work_name), m
