"""The service end to end: `python -m tx.run` as a real subprocess, driven by the official tinker SDK
(0.38) and by raw HTTP where the SDK cannot misbehave on purpose."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import tinker
import zstandard
from tinker.proto.response_conv import deserialize_forward_backward_output

from tests.api import sdk_flows
from tests.api.server_proc import ADMIN_KEY, API_KEY, Server
from tests.distributed import test_multihost as multihost
from tests.pg_server import PostgresUnavailable, postgres_server
from tests.require import skip_or_fail

pytestmark = pytest.mark.slow
LIMITS = ("--max-body-bytes", str(8 << 20), "--max-decompressed-bytes", str(16 << 20), "--batch-window-s", "0.3")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("service")


@pytest.fixture(scope="module")
def server(data_dir):
    srv = Server(data_dir, *LIMITS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def flow(server):
    return sdk_flows.full_flow(server.url)


def test_sdk_full_flow(flow):
    assert flow["state"].startswith("tinker://")


def wait(server: Server, request_id: str):
    while True:
        r = server.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("application/x-protobuf"):
            return deserialize_forward_backward_output(r.content)
        body = r.json()
        if body.get("type") != "try_again":
            return body


def create_raw(server: Server, seed: int) -> str:
    session = server.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}}).json()["session_id"]
    r = server.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                                  "lora_config": {"rank": 8, "seed": seed}})
    return wait(server, r.json()["request_id"])["model_id"]


def proto_post(server: Server, body: bytes, **headers):
    return server.post("/api/v1/forward_backward", content=body,
                       headers={"Content-Type": "application/x-protobuf", **headers})


def test_two_clients_batched_together_equal_alone(server, data_dir, tmp_path):
    def run(seed: int, name: str) -> str:
        tc = sdk_flows.service(server.url).create_lora_training_client(base_model="tiny", rank=8, seed=seed).result()
        sdk_flows.train_steps(tc, sdk_flows.datums(seed), 4)
        return tc.save_weights_for_sampler(name).result().path

    alone = {seed: run(seed, f"alone{seed}") for seed in (1, 2)}
    before = server.get("/api/v1/metrics", key=ADMIN_KEY).json()["engine"].get("cross_tenant_forward_backward_calls", 0)
    together: dict[int, str] = {}
    threads = [threading.Thread(target=lambda s=s: together.__setitem__(s, run(s, f"together{s}"))) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = server.get("/api/v1/metrics", key=ADMIN_KEY).json()["engine"].get("cross_tenant_forward_backward_calls", 0)
    assert after - before >= 2, (before, after)
    for seed in (1, 2):
        w_alone = sdk_flows.adapter_weights(data_dir, alone[seed], tmp_path)
        w_together = sdk_flows.adapter_weights(data_dir, together[seed], tmp_path)
        assert w_alone.keys() == w_together.keys()
        for key in w_alone:
            np.testing.assert_allclose(w_together[key], w_alone[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert not np.allclose(*(sdk_flows.adapter_weights(data_dir, alone[s], tmp_path)["base_model.model.lm_head.lora_B.weight"]
                             for s in (1, 2)))


def test_out_of_order_and_retried_seq_ids_run_once_in_order(server):
    tokens = np.random.default_rng(5).integers(0, 500, (4, 17))
    optim = {"adam_params": {"learning_rate": 0.05}}
    # reference: the same three requests sent in order
    ref = create_raw(server, seed=3)
    ids = [proto_post(server, sdk_flows.fb_body(ref, 1, tokens)).json()["request_id"],
           server.post("/api/v1/optim_step", json={"model_id": ref, "seq_id": 2, **optim}).json()["request_id"],
           proto_post(server, sdk_flows.fb_body(ref, 3, tokens, forward_only=True)).json()["request_id"]]
    expected = [wait(server, i) for i in ids]

    model = create_raw(server, seed=3)
    third = proto_post(server, sdk_flows.fb_body(model, 3, tokens, forward_only=True)).json()["request_id"]
    second = server.post("/api/v1/optim_step", json={"model_id": model, "seq_id": 2, **optim}).json()["request_id"]
    first = proto_post(server, sdk_flows.fb_body(model, 1, tokens)).json()["request_id"]
    assert proto_post(server, sdk_flows.fb_body(model, 1, tokens)).json()["request_id"] == first  # retries
    assert server.post("/api/v1/optim_step", json={"model_id": model, "seq_id": 2, **optim}).json()["request_id"] == second
    got = [wait(server, i) for i in (first, second, third)]
    assert got[1]["metrics"]["accumulated_sequences"] == 4  # the retried forward_backward ran once
    np.testing.assert_allclose(got[0].metrics["loss:sum"], expected[0].metrics["loss:sum"], rtol=1e-6)
    np.testing.assert_allclose(got[2].metrics["loss:sum"], expected[2].metrics["loss:sum"], rtol=1e-6)
    assert got[2].metrics["loss:sum"] < got[0].metrics["loss:sum"]  # the forward saw the optim_step
    # (model_id, seq_id) identifies a request: a late retry of seq 1 gets its original future back
    assert server.post("/api/v1/optim_step", json={"model_id": model, "seq_id": 1, **optim}).json()["request_id"] == first
    # unloading frees the model's slot; its later requests are refused
    unload = server.post("/api/v1/unload_model", json={"model_id": model}).json()["request_id"]
    assert wait(server, unload) == {"model_id": model, "type": "unload_model"}
    r = server.post("/api/v1/optim_step", json={"model_id": model, "seq_id": 4, **optim})
    assert r.status_code == 400 and "unloaded" in r.json()["detail"]


def test_bad_requests_get_json_errors_and_server_keeps_serving(server, flow):
    model = create_raw(server, seed=4)
    tokens = np.random.default_rng(6).integers(0, 500, (2, 17))

    def check(r, status: int, words: str):
        assert r.status_code == status, (r.status_code, r.text)
        assert words in r.json()["detail"], r.json()

    check(server.post("/api/v1/create_session", key="tml-wrong", json={"tags": []}), 401, "X-API-Key")
    check(server.post("/api/v1/optim_step", json={"model_id": "sess-nope:train:0", "seq_id": 1}), 404, "not found")
    check(proto_post(server, b"\xff\xff\xff\xff"), 400, "protobuf")
    check(proto_post(server, b"\0" * (9 << 20)), 413, "exceeds")
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    assert len(bomb) < 1 << 20
    check(proto_post(server, bomb, **{"Content-Encoding": "zstd"}), 413, "decompressed")
    check(proto_post(server, b"(\xb5/\xfd garbage", **{"Content-Encoding": "zstd"}), 400, "zstd")
    check(server.post("/api/v1/create_model", json={"session_id": "x"}), 400, "base_model")
    # refused training requests still take their seq_id: the next one runs
    check(proto_post(server, sdk_flows.fb_body(model, 1, tokens, loss_fn="nope")), 400, "loss_fn 'nope'")
    check(server.post("/api/v1/save_weights", json={"model_id": model, "seq_id": 2, "path": "../../etc"}),
          400, "not a valid checkpoint name")
    check(server.post("/api/v1/save_weights", json={"model_id": model, "seq_id": 3, "path": "a/b"}), 400, "'a/b'")
    ok = wait(server, proto_post(server, sdk_flows.fb_body(model, 4, tokens, forward_only=True)).json()["request_id"])
    assert np.isfinite(ok.metrics["loss:sum"])
    session = server.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
    for path in ("tinker://../weights/x", "tinker://sess-a:train:0/weights/..", "file:///etc/passwd"):
        check(server.post("/api/v1/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                                   "model_path": path}), 400, "path")
    check(server.post("/api/v1/asample", json={"prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
                                               "num_samples": 100000, "base_model": "tiny"}), 400, "num_samples")
    # the failed future of a refused request says why, as JSON
    tc = sdk_flows.service(server.url).create_lora_training_client(base_model="tiny", rank=8).result()
    with pytest.raises(tinker.BadRequestError):
        tc.forward_backward(sdk_flows.datums(0), "no_such_loss").result()
    assert np.isfinite(tc.forward(sdk_flows.datums(0), "cross_entropy").result().metrics["loss:sum"])


def test_restart_keeps_results_and_checkpoints(tmp_path):
    """A server of its own (the module's keeps serving the other tests): work, stop, start on the same data."""
    first = Server(tmp_path)
    try:
        tc = sdk_flows.service(first.url).create_lora_training_client(base_model="tiny", rank=8, seed=13).result()
        model_id = tc.get_info().model_id
        sdk_flows.train_steps(tc, sdk_flows.datums(13), 2)
        state = tc.save_state("r1").result().path
        sampler_path = tc.save_weights_for_sampler("r1").result().path
        lp = sdk_flows.logprobs_of(tc.forward(sdk_flows.datums(13), "cross_entropy").result())
        tokens = np.random.default_rng(8).integers(0, 500, (2, 17))
        done_id = proto_post(first, sdk_flows.fb_body(model_id, 8, tokens, forward_only=True)).json()["request_id"]
        done = wait(first, done_id)
    finally:
        assert first.stop() == 143  # SIGTERM: clean shutdown, conventional status
    again = Server(tmp_path)
    try:
        assert wait(again, done_id).metrics == done.metrics
        rest = tinker.RestClient(base_url=again.url, api_key=API_KEY)
        assert {c.tinker_path for c in rest.list_checkpoints(model_id).result().checkpoints} == {state, sampler_path}
        run = rest.get_training_run(model_id).result()
        assert run.training_run_id == model_id and run.lora_rank == 8
        # the old model is no longer in the backend; a new one is restored from its saved state
        r = again.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 9, "adam_params": {}})
        assert r.status_code == 400 and "unloaded" in r.json()["detail"]
        sc = sdk_flows.service(again.url)
        restored = sc.create_training_client_from_state_with_optimizer(state).result()
        np.testing.assert_allclose(sdk_flows.logprobs_of(restored.forward(sdk_flows.datums(13), "cross_entropy").result()),
                                   lp, atol=1e-5)
        sampler = sc.create_sampling_client(model_path=sampler_path).result()
        out = sampler.sample(tinker.types.ModelInput.from_ints([1, 2, 3]), 1,
                             tinker.types.SamplingParams(max_tokens=3, stop=[])).result()
        assert len(out.sequences[0].tokens) == 3
    finally:
        again.stop()


def test_postgres_same_flow_and_restart(tmp_path):
    try:
        ctx = postgres_server(tmp_path)
        url = ctx.__enter__()
    except PostgresUnavailable as e:
        skip_or_fail(f"no PostgreSQL server can be started here: {e}")
    try:
        srv = Server(tmp_path / "data", "--database-url", url)
        try:
            flow = sdk_flows.full_flow(srv.url)
        finally:
            srv.stop()
        srv = Server(tmp_path / "data2", "--database-url", url)  # a restart: same database, new data dir
        try:
            checkpoints = srv.get(f"/api/v1/training_runs/{flow['model_id']}/checkpoints").json()["checkpoints"]
            assert {c["tinker_path"] for c in checkpoints} >= {flow["state"], flow["sampler"]}
            assert json.loads(srv.get("/api/v1/training_runs").text)["cursor"]["total_count"] >= 1
        finally:
            srv.stop()
    finally:
        ctx.__exit__(None, None, None)


def short_run(url: str) -> tuple[np.ndarray, list[int]]:
    tc = sdk_flows.service(url).create_lora_training_client(base_model="tiny", rank=8, seed=11).result()
    sdk_flows.train_steps(tc, sdk_flows.datums(11), 3)
    lp = sdk_flows.logprobs_of(tc.forward(sdk_flows.datums(11), "cross_entropy").result())
    sampler = tc.save_weights_and_get_sampling_client().result()
    tokens = sampler.sample(tinker.types.ModelInput.from_ints([5, 6, 7, 8]), 1,
                            tinker.types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result()
    return lp, tokens.sequences[0].tokens


def test_multihost_service_equals_one_process(server, tmp_path):
    """Process 0 serves, process 1 runs the worker loop: a (2, 2, 2) mesh over 2 x 4 CPU devices."""
    port = multihost._ports()
    coordinator = f"127.0.0.1:{port}"
    procs = ["--coordinator-address", coordinator, "--num-processes", "2"]
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen([sys.executable, "-m", "tx.run", *procs, "--process-id", "1"],
                                  env=multihost._env(4), cwd=multihost.ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            srv = Server(tmp_path / "data", *procs, "--process-id", "0", "--fully-sharded-data-parallel-size", "2",
                         "--tensor-parallel-size", "2", "--expert-parallel-size", "2", devices=4)
            try:
                multi = short_run(srv.url)
            finally:
                assert srv.stop() == 143
            assert worker.wait(timeout=60) == 0  # process 0's shutdown stops the worker
        finally:
            if worker.poll() is None:
                worker.kill()
    single = short_run(server.url)
    np.testing.assert_allclose(multi[0], single[0], atol=2e-5)
    assert multi[1] == single[1]
