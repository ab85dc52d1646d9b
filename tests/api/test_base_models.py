"""Several base models in one `python -m tx.run` (`--extra-base-model`): requests are routed by base_model.

Two tiny Qwen3 checkpoints with the same shapes and different random weights are served under hub ids
(`Qwen/Qwen3-8B` the default, `Qwen/Qwen3-4B` the extra one: directories in the server's working
directory), so only routing can tell them apart. References are transformers' log-probs on each one's
checkpoint (1e-4).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types as T

from tests.api import sdk_flows
from tests.api.server_proc import ADMIN_KEY, Server
from tests.distributed import test_multihost as multihost
from tests.helpers import hf_logprobs
from tx.models.tiny import TinySpec, write_tiny_model

A, B = "Qwen/Qwen3-8B", "Qwen/Qwen3-4B"
PROMPT = [5, 17, 300, 42, 9, 250, 77, 3, 120, 64]
TOL = 1e-4


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("models")
    write_tiny_model(run / A, TinySpec(seed=0))
    write_tiny_model(run / B, TinySpec(seed=7))  # same shapes: a wrong route would not fail on shapes
    return run


@pytest.fixture(scope="module")
def reference(run_dir) -> dict[str, np.ndarray]:
    """transformers' log-probs of PROMPT[1:] given its prefix, on each base model's checkpoint."""
    from transformers import AutoModelForCausalLM

    ids = np.asarray([PROMPT[:-1]])
    out = {}
    for name in (A, B):
        model = AutoModelForCausalLM.from_pretrained(run_dir / name, torch_dtype="float32").eval()
        out[name] = hf_logprobs(model, ids, np.ones_like(ids), np.asarray([PROMPT[1:]]))[0]
    return out


@pytest.fixture(scope="module")
def server(run_dir):
    srv = Server(run_dir / "data", "--extra-base-model", B, cwd=run_dir, base_model=A)
    yield srv
    srv.stop()


def scored(client) -> np.ndarray:
    lps = client.compute_logprobs(T.ModelInput.from_ints(PROMPT)).result()
    assert lps[0] is None
    return np.asarray(lps[1:], np.float64)


def test_startup_log_shows_each_model_and_its_memory(server):
    log = server.log()
    for name, default in ((A, "true"), (B, "false")):
        line = next(line for line in log.splitlines() if '"base_model_loaded"' in line and f'"{name}"' in line)
        assert f'"default": {default}' in line and '"base_weights_mib"' in line and '"adapter_slots": 23' in line


def test_capabilities_list_both_models(server):
    caps = sdk_flows.service(server.url).get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [A, B]


def test_teacher_on_second_base_model_scores_with_its_weights(server, reference):
    svc = sdk_flows.service(server.url)

    def sample_calls() -> dict[str, int]:
        calls = server.get("/api/v1/metrics", key=ADMIN_KEY).json()["backend_calls_by_base_model"]
        return {name: sum(n for call, n in calls[name].items() if call.startswith("sample")) for name in (A, B)}

    before = sample_calls()
    teacher = scored(svc.create_sampling_client(base_model=B))
    after_teacher = sample_calls()
    assert after_teacher[B] > before[B] and after_teacher[A] == before[A]  # the call ran on B's backend only
    student = scored(svc.create_sampling_client(base_model=A))
    np.testing.assert_allclose(teacher, reference[B], atol=TOL)
    np.testing.assert_allclose(student, reference[A], atol=TOL)
    assert np.abs(reference[A] - reference[B]).max() > 0.05  # the two models are told apart


def test_training_on_one_model_leaves_the_other_untouched(server, reference):
    svc = sdk_flows.service(server.url)
    on_b = svc.create_lora_training_client(base_model=B, rank=8, seed=3).result()
    assert on_b.get_info().model_data.model_name == B
    data = [T.Datum(model_input=T.ModelInput.from_ints(PROMPT[:-1]),
                    loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)})]
    # a fresh adapter (B = 0) on model B computes B's base log-probs
    np.testing.assert_allclose(sdk_flows.logprobs_of(on_b.forward(data, "cross_entropy").result())[0],
                               reference[B], atol=TOL)
    on_a = svc.create_lora_training_client(base_model=A, rank=8, seed=4).result()
    losses = sdk_flows.train_steps(on_a, data, 2)
    assert losses[1] < losses[0]
    np.testing.assert_allclose(scored(svc.create_sampling_client(base_model=B)), reference[B], atol=TOL)
    np.testing.assert_allclose(sdk_flows.logprobs_of(on_b.forward(data, "cross_entropy").result())[0],
                               reference[B], atol=TOL)
    # a snapshot of B's adapter is sampled on B (its sampling session records base model B)
    np.testing.assert_allclose(scored(on_b.save_weights_and_get_sampling_client()), reference[B], atol=TOL)


def session_of(server: Server) -> str:
    r = server.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}})
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def test_unknown_base_model_is_refused_naming_it(server):
    session = session_of(server)
    for path, body in (("/api/v1/create_model", {"model_seq_id": 0, "lora_config": {"rank": 8}}),
                       ("/api/v1/create_sampling_session", {"sampling_session_seq_id": 0})):
        r = server.post(path, json={"session_id": session, "base_model": "Qwen/Qwen3-999B", **body})
        assert r.status_code == 400, r.text
        detail = r.json()["detail"]
        assert "'Qwen/Qwen3-999B'" in detail and A in detail and B in detail, detail
    with pytest.raises(tinker.BadRequestError, match="Qwen/Qwen3-999B"):
        sdk_flows.service(server.url).create_sampling_client(base_model="Qwen/Qwen3-999B").compute_logprobs(
            T.ModelInput.from_ints(PROMPT)).result()


def test_checkpoint_of_one_base_model_is_refused_on_the_other(server):
    svc = sdk_flows.service(server.url)
    on_a = svc.create_lora_training_client(base_model=A, rank=8, seed=5).result()
    state = on_a.save_state("a-state").result().path
    sampler = on_a.save_weights_for_sampler("a-sampler").result().path
    session = session_of(server)
    r = server.post("/api/v1/load_weights", json={"session_id": session, "model_seq_id": 0, "path": state,
                                                   "base_model": B, "optimizer": False})
    assert r.status_code == 400 and f"trained on base model '{A}'" in r.json()["detail"], r.text
    r = server.post("/api/v1/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                             "model_path": sampler, "base_model": B})
    assert r.status_code == 400 and f"trained on base model '{A}'" in r.json()["detail"], r.text
    on_b = svc.create_lora_training_client(base_model=B, rank=8, seed=6).result()
    with pytest.raises(Exception, match=f"trained on base model '{A}'"):
        on_b.load_state(state).result()
    # without base_model the checkpoint's own base model is used
    restored = svc.create_training_client_from_state(state).result()
    assert restored.get_info().model_data.model_name == A


@pytest.mark.slow
def test_two_hosts_run_calls_on_the_extra_model(run_dir, reference, tmp_path):
    """Process 0 serves both models, process 1 runs the worker loop over a mesh spanning both: a call on B
    completes only if the worker runs it on its own B backend (collectives need every host)."""
    port = multihost._ports()
    procs = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2"]
    a_dir, b_dir = str(run_dir / A), str(run_dir / B)
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen([sys.executable, "-m", "tx.run", *procs, "--process-id", "1"], env=multihost._env(2),
                                  cwd=multihost.ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            srv = Server(tmp_path / "data", *procs, "--process-id", "0", "--fully-sharded-data-parallel-size", "2",
                         "--tensor-parallel-size", "2", "--extra-base-model", b_dir, base_model=a_dir, devices=2)
            try:
                svc = sdk_flows.service(srv.url)
                np.testing.assert_allclose(scored(svc.create_sampling_client(base_model=b_dir)), reference[B], atol=TOL)
                svc.create_lora_training_client(base_model=b_dir, rank=8, seed=1).result()
            finally:
                assert srv.stop() == 143
            assert worker.wait(timeout=60) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
    worker_log = (tmp_path / "worker.log").read_text()
    assert f"backend {b_dir!r} ready: base model {b_dir}" in worker_log, worker_log[-3000:]
    assert "created model" in worker_log and "in slot 1 (rank 8)" in worker_log, worker_log[-3000:]
