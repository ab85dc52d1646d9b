"""tinker-cookbook's on-policy distillation recipe, unmodified, with the teacher a second base model.

The server holds two tiny Qwen3 checkpoints (different random weights) under hub ids: the student
`Qwen/Qwen3-8B` (`--base-model`) and the teacher `Qwen/Qwen3-4B` (`--extra-base-model`), directories in
the working directory where the recipe also finds `zwhe99/DeepMath-103K` (prompts written by the test).
The recipe scores its samples with `create_sampling_client(base_model=teacher).compute_logprobs`, so
its `teacher_kl` metric needs the teacher's calls to run on the teacher's backend.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.api.server_proc import ADMIN_KEY, API_KEY, Server
from tests.require import require_module
from tx.models.tiny import TinySpec, write_tiny_model

require_module("tinker_cookbook")
pytestmark = pytest.mark.slow

STUDENT, TEACHER = "Qwen/Qwen3-8B", "Qwen/Qwen3-4B"
STEPS = 2
QUESTIONS = ["What is 2 + 3?", "Compute 7 * 6.", "What is 10 - 4?", "Is 9 prime?"]


def test_on_policy_distillation_with_a_teacher_on_another_base_model(tmp_path):
    run = tmp_path / "run"
    write_tiny_model(run / STUDENT, TinySpec(seed=0))
    write_tiny_model(run / TEACHER, TinySpec(seed=7))
    data = run / "zwhe99" / "DeepMath-103K"
    data.mkdir(parents=True)
    (data / "train.jsonl").write_text("".join(json.dumps({"question": q}) + "\n" for q in QUESTIONS * 2))
    server = Server(tmp_path / "data", "--extra-base-model", TEACHER, "--max-seq-len", "512", cwd=run,
                    base_model=STUDENT)
    try:
        env = {**os.environ, "TINKER_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "TINKER_TELEMETRY": "0"}
        for var in ("XLA_FLAGS", "JAX_PLATFORMS"):
            env.pop(var, None)
        log_path = tmp_path / "distill"
        cmd = [sys.executable, "-m", "tinker_cookbook.recipes.distillation.on_policy_distillation",
               f"base_url={server.url}", f"model_name={STUDENT}", f"teacher_model={TEACHER}", "dataset=deepmath",
               "lora_rank=8", "group_size=2", "groups_per_batch=2", "max_tokens=8", "learning_rate=1e-4",
               f"max_steps={STEPS}", "eval_every=0", "save_every=0", f"log_path={log_path}",
               "behavior_if_log_dir_exists=delete"]
        recipe_log = tmp_path / "recipe.log"
        with open(recipe_log, "w") as out:
            try:
                rc = subprocess.run(cmd, cwd=run, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=300,
                                    check=False).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        assert rc == 0, f"recipe: {rc}\n{recipe_log.read_text()[-6000:]}\n--- server ---\n{server.log()[-4000:]}"
        metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line]
        assert [m["step"] for m in metrics] == list(range(STEPS)), metrics
        for m in metrics:
            assert math.isfinite(m["teacher_kl"]), m
        # at step 0 the student is its base model (LoRA B = 0): the KL is 0 if the teacher is the same model
        assert abs(metrics[0]["teacher_kl"]) > 0.05, metrics[0]  # measured 0.30
        calls = server.get("/api/v1/metrics", key=ADMIN_KEY).json()["backend_calls_by_base_model"]
        assert calls[TEACHER].get("score_prompts", 0) >= STEPS, calls  # the teacher's compute_logprobs ran on it
        assert "forward_backward" not in calls[TEACHER] and "optim_step" not in calls[TEACHER], calls
        assert calls[STUDENT].get("forward_backward", 0) >= STEPS and calls[STUDENT].get("optim_step", 0) >= STEPS
    finally:
        server.stop()
