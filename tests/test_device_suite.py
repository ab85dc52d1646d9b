"""benchmarks/device/: the GPU suite's dry run (every step's code path at tiny shapes on CPU), its peak and
FLOP tables, and that the wheel folder it ships stays out of git."""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import one_device_env

ROOT = Path(__file__).parents[1]
DEVICE = ROOT / "benchmarks" / "device"
COMMON_KEYS = {"suite", "step", "workload", "framework", "dry_run", "device", "platform", "jax_version", "shapes",
               "tokens_per_s", "step_time_s", "compiles", "mfu", "peak_bytes_in_use", "host_max_rss_bytes",
               "elapsed_s", "error"}
# the dry run's workloads per step (tiny shapes: decode batches 1, 2, 4; attention timed at t=128)
EXPECTED = {
    "setup": ["setup_models"],
    "a": ["attention_parity_unpacked", "attention_parity_packed", "attention_time_t128"],
    "b": ["lora_train_1_adapter", "lora_train_8_adapters"],
    "c": ["full_train"],
    "d": ["decode_b1", "decode_b2", "decode_b4", "decode_sync_b1", "decode_scan_b1"],
    "g": ["lora_train_1_adapter", "lora_train_8_adapters", "decode_b1", "decode_b2"],
    "e": ["rl_sample"],
}


def load_suite():
    spec = importlib.util.spec_from_file_location("device_suite", DEVICE / "suite.py")
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path  # suite.py puts benchmarks/ on the path for its steps; not for the test process
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device")
    # one CPU device, as a GPU box, with the tests' cheap-compile XLA flags (tests/helpers.py)
    env = {k: v for k, v in one_device_env().items() if k != "PYTHONPATH"}
    # the JAX compile cache outlives the test (safe to share): a rerun on this machine skips XLA compiles
    env |= {"PYTHON": sys.executable, "TX_DEVICE_WORK": str(out / "work"),
            "JAX_COMPILATION_CACHE_DIR": str(Path(tempfile.gettempdir()) / "tx-device-dry-jax-cache")}
    proc = subprocess.run(["bash", str(DEVICE / "run.sh"), str(out / "results"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results" / "results.jsonl").read_text().splitlines()]
    return out / "results", rows, proc.stdout


@pytest.mark.slow
def test_dry_run_writes_every_step_without_error(dry_run):
    results, rows, stdout = dry_run
    by_step = {}
    for row in rows:
        by_step.setdefault(row["step"], []).append(row)
    assert {s: [r["workload"] for r in rs] for s, rs in by_step.items()} == EXPECTED
    for row in rows:
        assert COMMON_KEYS <= set(row), (row["step"], row["workload"], COMMON_KEYS - set(row))
        assert row["error"] is None, (row["step"], row["workload"], row["error"], row.get("traceback_tail"))
        assert row["dry_run"] is True and row["jax_version"]
    summary = json.loads((results / "summary.json").read_text())
    assert summary["errors"] == 0 and summary["lines"] == len(rows)
    assert "nvidia-smi" in (results / "env.txt").read_text() and "jax" in (results / "env.txt").read_text()
    assert all(json.loads(line) == row for line, row in zip(
        [ln for ln in stdout.splitlines() if ln.startswith("{\"suite\"")], rows))  # shown as they finish


@pytest.mark.slow
def test_dry_run_values(dry_run):
    _, rows, _ = dry_run
    line = {(r["step"], r["workload"]): r for r in rows}
    for name in ("attention_parity_unpacked", "attention_parity_packed"):
        r = line["a", name]
        # off GPU tx's cuDNN dispatch runs its blockwise kernel: the output equals it bit for bit
        assert r["ran"] == "blockwise" and r["ran_by"] == "bitwise" and r["within_tolerance"], r
        assert 0 < r["max_abs_error"] <= r["tolerance"]
    assert line["a", "attention_parity_unpacked"]["cudnn_takes_rows"] is True
    assert line["a", "attention_parity_packed"]["cudnn_takes_rows"] is False
    for step in ("b", "g"):
        for name in ("lora_train_1_adapter", "lora_train_8_adapters"):
            r = line[step, name]
            assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["model_flops_per_step"] > 0
            assert "mfu" in r and r["mfu"] is None  # no peak is claimed for a CPU
    assert line["b", "lora_train_8_adapters"]["optim_steps_per_step"] == 8
    assert line["g", "lora_train_1_adapter"]["ratio_tx_over_torch_tokens_per_s"] > 0
    for step, name in [("b", "lora_train_1_adapter"), ("b", "lora_train_8_adapters"), ("c", "full_train"),
                       ("d", "decode_b1"), ("d", "decode_b4"), ("e", "rl_sample")]:
        assert line[step, name]["compiles"] >= 1 and line[step, name]["compiles_during_timing"] == 0, (step, name)
    assert line["c", "full_train"]["step_time_s"] > 0 and set(line["c", "full_train"]["state_mib"]) >= {"params", "adam"}
    for name in ("decode_b1", "decode_b2", "decode_b4"):
        assert "hbm_fraction" in line["d", name] and line["d", name]["prefill_tokens_per_s"] > 0
    assert line["d", "decode_b1"]["shapes"]["paged_attention_impl"] == "blocked"
    assert line["d", "decode_b1"]["shapes"]["decode_layers"] == "unrolled"  # "auto" on one CPU device
    sync = line["d", "decode_sync_b1"]  # async dispatch off, same backend: the same programs and tokens
    assert not sync["shapes"]["paged_async_dispatch"] and line["d", "decode_b1"]["shapes"]["paged_async_dispatch"]
    assert sync["chained_calls"] == 0 and sync["compiles_during_timing"] == 0, sync
    assert sync["greedy_vs_default"]["identical_rows"] == 2, sync["greedy_vs_default"]
    scan = line["d", "decode_scan_b1"]
    assert scan["shapes"]["decode_layers"] == "scan" and scan["tokens_per_s"] > 0
    assert scan["greedy_vs_default"]["rows"] == 2, scan["greedy_vs_default"]
    assert line["e", "rl_sample"]["tokens_per_s"] > 0 and line["e", "rl_sample"]["shapes"]["generated_tokens"] == 128
    assert "ratio_tx_over_torch_tokens_per_s" in line["g", "decode_b1"]


def test_peaks_and_flop_counts():
    suite = load_suite()
    assert suite.peaks("NVIDIA H100 80GB HBM3") == (989.4e12, 3.35e12)  # SXM
    assert suite.peaks("NVIDIA H200") == (989.4e12, 4.8e12)
    assert suite.peaks("NVIDIA H100 PCIe")[1] == 2.0e12
    assert suite.peaks("cpu") == (None, None)
    # Qwen's model cards: Qwen3-1.7B has 1.4B non-embedding parameters, Qwen3-0.6B 0.44B
    for name, non_embedding in (("qwen3_1p7b", 1.4e9), ("qwen3_0p6b", 0.44e9)):
        m = suite.model_shape(False, name)
        assert suite.matmul_params(m) - m.vocab_size * m.hidden_size == pytest.approx(non_embedding, rel=0.01)
    m = suite.model_shape(False, "qwen3_1p7b")
    # a layer's q projection alone at rank 32: 32 x (2048 + 2048) LoRA weights
    assert suite.lora_params(m, 32) > 28 * 32 * 4096
    # full training = 6N per token + 3x the attention forward; LoRA drops the base weights' gradients (2N)
    tokens, t = 4096, 1024
    full, lora = suite.full_train_flops(m, tokens, t), suite.lora_train_flops(m, 32, tokens, t)
    assert full - lora == pytest.approx(tokens * (2 * suite.matmul_params(m) - 6 * suite.lora_params(m, 32)))


def test_failed_step_gets_an_error_line_per_missing_workload(tmp_path):
    """run.sh's path for a step that timed out or crashed: the workloads it wrote keep their lines, each
    missing one gets an error line with the same keys and the log's tail."""
    results, log = tmp_path / "results.jsonl", tmp_path / "d.log"
    results.write_text(json.dumps({"step": "d", "workload": "decode_b1", "error": None}) + "\n")
    log.write_text("Traceback ...\nRuntimeError: boom\n")
    subprocess.run([sys.executable, str(DEVICE / "suite.py"), "fail", "--results", str(results), "--step", "d",
                    "--message", "timeout: step d ran past its 120s limit", "--log", str(log), "--dry-run"],
                   check=True, capture_output=True)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["workload"] for r in rows] == EXPECTED["d"]
    for row in rows[1:]:
        assert COMMON_KEYS <= set(row) and row["error"].startswith("timeout") and "boom" in row["log_tail"]


def test_wheel_folder_is_ignored_by_git():
    for path in (".whl/pydantic-2.0-py3-none-any.whl", ".whl/SHIPPED.txt"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path
