"""The HTTP app in-process (FastAPI's TestClient) over a real SQLite store and an engine whose thread is
not started, so requests stay queued: auth, body limits, long-poll try-again, sampling back-pressure."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tx.api.app import ApiConfig, ServedModel, create_app
from tx.engine.engine import Engine, EngineConfig
from tx.engine.store import Store

KEY = "tml-app-test"


def never(_output):
    raise AssertionError("nothing runs: the engine thread is not started")


@pytest.fixture
def client(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'tx.sqlite'}")
    engine = Engine(None, store, EngineConfig(checkpoint_root=str(tmp_path), max_queued_samples=4), "tiny", never, never)
    served = ServedModel(model_name="tiny", aliases=["tiny"], tokenizer_id="tiny", arch="Qwen3ForCausalLM",
                         max_context_length=128, max_lora_rank=8, max_num_samples=8)
    app = create_app(engine, store, ApiConfig(api_keys=[KEY], max_body_bytes=2048, long_poll_s=0.2), served)
    with TestClient(app, headers={"X-API-Key": KEY}) as c:
        c.engine = engine
        yield c
    store.close()


def sample(client, session: str, seq_id: int, n: int):
    return client.post("/api/v1/asample", json={
        "prompt": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]}, "num_samples": n,
        "sampling_params": {"max_tokens": 4}, "sampling_session_id": session, "seq_id": seq_id})


def test_auth_and_body_limit(client):
    assert client.post("/api/v1/client/config", json={}, headers={"X-API-Key": "tml-other"}).status_code == 401
    assert client.get("/api/v1/healthz", headers={"X-API-Key": ""}).status_code == 200
    r = client.post("/api/v1/create_session", content=b"{" + b" " * 4096 + b"}",
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit of 2048" in r.json()["detail"]


def test_sampling_back_pressure_and_try_again(client):
    session = client.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
    sampler = client.post("/api/v1/create_sampling_session", json={
        "session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny"}).json()["sampling_session_id"]
    first = sample(client, sampler, 0, 3)
    assert first.status_code == 200 and len(first.json()["sample_sequence_ids"]) == 3
    full = sample(client, sampler, 1, 3)  # 3 queued + 3 > 4
    assert full.status_code == 429 and full.headers["retry-after"] == "1" and "queued" in full.json()["detail"]
    assert sample(client, sampler, 0, 3).json() == first.json()  # a resend is not refused: same future
    pending = client.post("/api/v1/retrieve_future", json={"request_id": first.json()["request_id"]})
    assert pending.json()["type"] == "try_again"
    assert client.post("/api/v1/retrieve_future", json={"request_id": "req-unknown"}).status_code == 404


def test_unsupported_training_call_keeps_the_models_order(client):
    """save_weights_external is refused with a 400 that still consumes its seq_id."""
    session = client.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
    model = client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                                       "lora_config": {"rank": 4}}).json()["model_id"]
    r = client.post("/api/v1/save_weights_external", json={"model_id": model, "seq_id": 1, "path": "x"})
    assert r.status_code == 400 and "not supported" in r.json()["detail"]
    nxt = client.post("/api/v1/optim_step", json={"model_id": model, "seq_id": 2, "adam_params": {}})
    assert nxt.status_code == 200
    waiting = client.engine.scheduler.models[model].waiting  # the engine is not running: all still queued
    assert sorted(waiting) == [0, 1, 2] and waiting[1].kind == "rejected" and waiting[2].kind == "optim_step"
