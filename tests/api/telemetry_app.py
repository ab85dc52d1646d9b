"""The app in-process (FastAPI's TestClient) over a real engine thread and a tiny JAX backend, with two tenant
keys and an admin key, and a known sequence of requests sent as raw HTTP: what the Prometheus, metrics and
trace tests check the server's records against."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np
from fastapi.testclient import TestClient

from tests.api import sdk_flows
from tx.api import wire
from tx.api.app import ApiConfig, ServedModel, create_app
from tx.engine.engine import Engine, EngineConfig
from tx.engine.store import Store

KEY = "tml-telemetry-tenant"
OTHER = "tml-telemetry-stranger"
ADMIN = "tml-telemetry-admin"
ROWS, LENGTH = 2, 8  # each forward_backward: 2 datums of 8 input tokens
SAMPLES, MAX_TOKENS = 2, 4
PROMPT = [1, 2, 3, 4]


def headers(key: str) -> dict[str, str]:
    return {"X-API-Key": key}


@contextlib.contextmanager
def app_client(tmp_path, backend) -> Iterator[TestClient]:
    store = Store(f"sqlite:///{tmp_path / 'tx.sqlite'}")
    engine = Engine(backend, store, EngineConfig(checkpoint_root=str(tmp_path / "ck")), "tiny", wire.encode_pass,
                    wire.encode_sample)
    served = ServedModel(model_name="tiny", aliases=["tiny"], tokenizer_id="tiny", arch="Qwen3ForCausalLM",
                         max_context_length=32, max_lora_rank=4, max_num_samples=4)
    config = ApiConfig(api_keys=[KEY, OTHER], admin_api_keys=[ADMIN], long_poll_s=5)
    engine.start()
    try:
        with TestClient(create_app(engine, store, config, served), headers=headers(KEY)) as client:
            client.engine = engine
            yield client
    finally:
        engine.stop()
        for model_id in list(backend.models):  # free the adapter slots for the next test
            backend.delete_model(model_id)
        store.close()


def result(client: TestClient, request_id: str, key: str = KEY, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers(key))
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith(wire.PROTO):
            return r.content
        body = r.json()
        if body.get("type") != "try_again":
            assert "error" not in body, body
            return body
    raise AssertionError(f"future {request_id} did not finish in {timeout} s")


def run_session(client: TestClient, forward_backward: int = 2, optim_step: int = 1, sample: int = 1,
                key: str = KEY, seed: int = 0) -> tuple[str, list[tuple[str, str]]]:
    """A session of tenant `key` with one model: create it, then `forward_backward` passes, then `optim_step`
    steps (all sent before any result is read, as the SDK pipelines them), then `sample` sampling requests one
    after another. Returns the session id and the (kind, request_id) of the requests sent, in order."""
    def post(path: str, **kw):
        r = client.post(path, headers={**headers(key), **kw.pop("headers", {})}, **kw)
        assert r.status_code == 200, r.text
        return r.json()

    session = post("/api/v1/create_session", json={})["session_id"]
    created = post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                                 "lora_config": {"rank": 4}})
    model_id = created["model_id"]
    result(client, created["request_id"], key)
    sent, seq = [("create_model", created["request_id"])], 1
    tokens = np.random.default_rng(seed).integers(0, 500, (ROWS, LENGTH + 1))
    for _ in range(forward_backward):
        r = post("/api/v1/forward_backward", content=sdk_flows.fb_body(model_id, seq, tokens),
                 headers={"Content-Type": wire.PROTO})
        sent.append(("forward_backward", r["request_id"]))
        seq += 1
    for _ in range(optim_step):
        r = post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": seq,
                                             "adam_params": {"learning_rate": 1e-3}})
        sent.append(("optim_step", r["request_id"]))
        seq += 1
    for _, request_id in sent[1:]:
        result(client, request_id, key)
    if sample:
        sampler = post("/api/v1/create_sampling_session", json={
            "session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny"})["sampling_session_id"]
        for i in range(sample):
            r = post("/api/v1/asample", json={
                "prompt": {"chunks": [{"tokens": PROMPT, "type": "encoded_text"}]}, "num_samples": SAMPLES,
                "sampling_params": {"max_tokens": MAX_TOKENS, "seed": i, "stop": []},
                "sampling_session_id": sampler, "seq_id": i})
            result(client, r["request_id"], key)
            sent.append(("sample", r["request_id"]))
    return session, sent
