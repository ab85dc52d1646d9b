"""tinker-cookbook's `sl_loop` recipe, unmodified, trains against a real `python -m tx.run` server.

The recipe hard-codes two hub ids: the tokenizer of `model_name` and the `HuggingFaceH4/no_robots`
dataset. Run from a directory holding `Qwen/Qwen3-8B` (the tiny model) and
`HuggingFaceH4/no_robots/data/train.jsonl` (a small chat set), with the HF libraries offline, both
resolve to those local paths; the server, started in the same directory with base model
`Qwen/Qwen3-8B`, loads the same tiny model.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.api.server_proc import API_KEY, Server
from tests.require import require_module

require_module("tinker_cookbook")
pytestmark = pytest.mark.slow

MODEL = "Qwen/Qwen3-8B"
STEPS, SAVE_EVERY, BATCH = 3, 2, 4

QA = [
    ("What is the capital of France?", "Paris."),
    ("Add two and three.", "Five."),
    ("Say hello.", "Hello there!"),
    ("Name a color.", "Blue."),
    ("What do cats say?", "Meow."),
    ("Is water wet?", "Yes, it is."),
    ("Count to three.", "One, two, three."),
    ("Opposite of hot?", "Cold."),
]


def write_run_dir(run: Path, tiny_dir: str, n: int = 16) -> None:
    """`run/Qwen/Qwen3-8B` -> the tiny model; `run/HuggingFaceH4/no_robots/data/train.jsonl`: n chats."""
    (run / "Qwen").mkdir(parents=True)
    (run / MODEL).symlink_to(Path(tiny_dir).resolve(), target_is_directory=True)
    data = run / "HuggingFaceH4" / "no_robots" / "data"
    data.mkdir(parents=True)
    with open(data / "train.jsonl", "w") as f:
        for i in range(n):
            q, a = QA[i % len(QA)]
            system = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
            messages = system + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"prompt": q, "prompt_id": f"p{i}", "messages": messages, "category": "QA"}) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_sl_loop_recipe_against_server(tmp_path, tiny_dirs):
    run = tmp_path / "run"
    write_run_dir(run, tiny_dirs["dense"])
    data_dir, log_path, hf_home = tmp_path / "data", tmp_path / "sl_loop", tmp_path / "hf_home"
    server = Server(data_dir, "--session-timeout-s", "600", "--max-seq-len", "512", cwd=run, base_model=MODEL)
    try:
        env = {**os.environ, "TINKER_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(hf_home), "TINKER_TELEMETRY": "0"}
        for var in ("XLA_FLAGS", "JAX_PLATFORMS"):  # set by conftest for this process; the recipe has no use for them
            env.pop(var, None)
        cmd = [sys.executable, "-m", "tinker_cookbook.recipes.sl_loop", f"base_url={server.url}",
               f"model_name={MODEL}", f"batch_size={BATCH}", "lora_rank=8", f"max_steps={STEPS}",
               f"save_every={SAVE_EVERY}", f"log_path={log_path}"]
        recipe_log = tmp_path / "sl_loop.log"
        start = time.time()
        with open(recipe_log, "w") as out:
            try:
                rc = subprocess.run(cmd, cwd=run, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=300,
                                    check=False).returncode
            except subprocess.TimeoutExpired:
                pytest.fail(f"sl_loop ran past 300 s\n--- recipe ---\n{recipe_log.read_text()[-6000:]}"
                            f"\n--- server ---\n{server.log()[-6000:]}")
        elapsed = time.time() - start
        assert rc == 0, (f"sl_loop exited {rc} after {elapsed:.0f} s\n--- recipe ---\n{recipe_log.read_text()[-6000:]}"
                         f"\n--- server ---\n{server.log()[-6000:]}")

        # The recipe's own records: checkpoints.jsonl (one line per save) and metrics.jsonl (one per step).
        saved = read_jsonl(log_path / "checkpoints.jsonl")
        assert [c["name"] for c in saved] == [f"{SAVE_EVERY:06d}", "final"], saved
        assert all(c["state_path"].startswith("tinker://") for c in saved), saved
        assert "sampler_path" not in saved[0] and saved[1]["sampler_path"].startswith("tinker://"), saved
        run_id = saved[0]["state_path"][len("tinker://"):].split("/")[0]
        assert saved[0]["state_path"] == f"tinker://{run_id}/weights/{SAVE_EVERY:06d}"
        assert saved[1]["state_path"] == f"tinker://{run_id}/weights/final"
        assert saved[1]["sampler_path"] == f"tinker://{run_id}/sampler_weights/final"

        metrics = read_jsonl(log_path / "metrics.jsonl")
        assert [m["step"] for m in metrics] == list(range(STEPS)), metrics
        for m in metrics:
            assert m["num_sequences"] == BATCH and m["num_tokens"] > 0, m
            assert math.isfinite(m["train_mean_nll"]) and m["train_mean_nll"] > 0, m

        # The server lists the same checkpoints for the run...
        r = server.get(f"/api/v1/training_runs/{run_id}/checkpoints")
        assert r.status_code == 200, r.text
        listed = {c["checkpoint_id"]: c for c in r.json()["checkpoints"]}
        expected = {f"weights/{SAVE_EVERY:06d}": "training", "weights/final": "training",
                    "sampler_weights/final": "sampler"}
        assert set(listed) == set(expected), listed
        for cid, ctype in expected.items():
            assert listed[cid]["checkpoint_type"] == ctype, listed[cid]
            assert listed[cid]["tinker_path"] == f"tinker://{run_id}/{cid}", listed[cid]

        # ...and their files are under <data_dir>/checkpoints/<run_id>/<kind>/<name>[.tar.gz].
        root = data_dir / "checkpoints" / run_id
        for path in (root / "weights" / f"{SAVE_EVERY:06d}", root / "weights" / "final",
                     root / "sampler_weights" / "final.tar.gz"):
            assert path.exists(), f"{path} missing; have {sorted(str(p.relative_to(data_dir)) for p in root.rglob('*'))}"
            if path.is_dir():
                assert any(p.is_file() and p.stat().st_size > 0 for p in path.rglob("*")), path
            else:
                assert path.stat().st_size > 0, path
    finally:
        server.stop()
