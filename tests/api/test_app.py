"""The HTTP app in-process (FastAPI's TestClient) over a real SQLite store and an engine whose thread is
not started, so requests stay queued: auth, body limits, long-poll try-again, sampling back-pressure."""

from __future__ import annotations

import time

import httpx
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


def test_refused_training_call_keeps_the_models_order(client):
    """A save_weights_external refused at submit (bad name) is a 400 that still consumes its seq_id."""
    session = client.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
    model = client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                                       "lora_config": {"rank": 4}}).json()["model_id"]
    r = client.post("/api/v1/save_weights_external", json={"model_id": model, "seq_id": 1, "path": "../x"})
    assert r.status_code == 400 and "path '../x' is not a valid checkpoint name" in r.json()["detail"]
    nxt = client.post("/api/v1/optim_step", json={"model_id": model, "seq_id": 2, "adam_params": {}})
    assert nxt.status_code == 200
    waiting = client.engine.scheduler.models[model].waiting  # the engine is not running: all still queued
    assert sorted(waiting) == [0, 1, 2] and waiting[1].kind == "rejected" and waiting[2].kind == "optim_step"


# ---- issue 12 #8: nothing blocks the event loop; #12: request size caps ----

def make_app(tmp_path, **engine_config):
    store = Store(f"sqlite:///{tmp_path / 'tx.sqlite'}")
    engine = Engine(None, store, EngineConfig(checkpoint_root=str(tmp_path), **engine_config), "tiny", never, never)
    served = ServedModel(model_name="tiny", aliases=["tiny"], tokenizer_id="tiny", arch="Qwen3ForCausalLM",
                         max_context_length=128, max_lora_rank=8, max_num_samples=8)
    return create_app(engine, store, ApiConfig(api_keys=[KEY], long_poll_s=0.3), served), engine, store


async def new_model(http) -> tuple[str, str]:
    """A session and a model whose create future stays pending (the engine thread is not started)."""
    session = (await http.post("/api/v1/create_session", json={"tags": []})).json()["session_id"]
    created = (await http.post("/api/v1/create_model", json={
        "session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}})).json()
    return created["model_id"], created["request_id"]


async def longest_stall(http, busy, seconds: float) -> float:
    """Ping healthz every 20 ms while `busy` runs: the longest time between two answers (a stall of the
    event loop shows whether it hits a ping or the sleep between two)."""
    import asyncio

    task = asyncio.ensure_future(busy)
    worst, last = 0.0, time.monotonic()
    deadline = last + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        assert (await http.get("/api/v1/healthz")).status_code == 200
        worst, last = max(worst, time.monotonic() - last), time.monotonic()
    await task
    return worst


def test_a_slow_store_write_does_not_freeze_other_requests(tmp_path, monkeypatch):
    import asyncio

    app, engine, store = make_app(tmp_path)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t",
                                     headers={"X-API-Key": KEY}) as http:
            model_id, create = await new_model(http)
            real = store.add_future
            monkeypatch.setattr(store, "add_future", lambda *a, **k: (time.sleep(2.0), real(*a, **k))[1])

            async def busy():
                step = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {}})
                polls = [http.post("/api/v1/retrieve_future", json={"request_id": create}) for _ in range(3)]
                answers = await asyncio.gather(step, *polls)
                assert answers[0].status_code == 200
                assert all(a.json()["type"] == "try_again" for a in answers[1:])

            return await longest_stall(http, busy(), 2.5)

    stall = asyncio.run(scenario())
    store.close()
    assert stall < 0.5, f"healthz waited {stall:.2f} s while a store write was slow"


def test_a_large_forward_backward_body_is_decoded_off_the_event_loop(tmp_path, monkeypatch):
    import asyncio
    import threading

    import numpy as np

    from tests.api.sdk_flows import fb_body
    from tx.api import wire

    app, engine, store = make_app(tmp_path, max_request_tokens=1 << 20)
    decoded_on: list[str] = []
    real = wire.decode_forward_backward

    def slow_decode(body):
        decoded_on.append(threading.current_thread().name)
        time.sleep(1.0)  # as a multi-MiB body takes on a loaded machine
        return real(body)

    monkeypatch.setattr(wire, "decode_forward_backward", slow_decode)
    rows = np.random.default_rng(0).integers(0, 500, (60, 8193))

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t",
                                     headers={"X-API-Key": KEY}) as http:
            model_id, _ = await new_model(http)
            body = fb_body(model_id, 1, rows)
            assert len(body) > 7.5 * 2**20

            async def busy():
                r = await http.post("/api/v1/forward_backward", content=body,
                                    headers={"Content-Type": "application/x-protobuf"})
                assert r.status_code == 200, r.text

            return await longest_stall(http, busy(), 1.5)

    stall = asyncio.run(scenario())
    store.close()
    assert decoded_on and decoded_on[0] != threading.main_thread().name
    assert stall < 0.5, f"healthz waited {stall:.2f} s while a large body was decoded"
    assert engine.scheduler.models[next(iter(engine.scheduler.models))].waiting[1].tokens == 60 * 8192


def test_requests_over_the_size_caps_get_413_and_keep_the_models_order(tmp_path):
    import numpy as np

    from tests.api.sdk_flows import fb_body

    app, engine, store = make_app(tmp_path, max_pass_datums=8, max_request_tokens=100, max_pass_tokens=1000)
    with TestClient(app, headers={"X-API-Key": KEY}) as c:
        session = c.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        model = c.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                                     "lora_config": {"rank": 4}}).json()["model_id"]
        headers = {"Content-Type": "application/x-protobuf"}
        many = c.post("/api/v1/forward_backward", content=fb_body(model, 1, np.ones((9, 3), int)), headers=headers)
        assert many.status_code == 413 and "max_pass_datums=8" in many.json()["detail"]
        assert "9 datums" in many.json()["detail"]
        long = c.post("/api/v1/forward_backward", content=fb_body(model, 2, np.ones((2, 52), int)), headers=headers)
        assert long.status_code == 413 and "max_request_tokens=100" in long.json()["detail"]
        assert "data has 102 tokens" in long.json()["detail"]
        fits = c.post("/api/v1/forward_backward", content=fb_body(model, 3, np.ones((8, 13), int)), headers=headers)
        assert fits.status_code == 200
    waiting = engine.scheduler.models[model].waiting
    assert [waiting[s].kind for s in (1, 2, 3)] == ["rejected", "rejected", "forward_backward"]
    assert waiting[3].tokens == 96 and waiting[3].size == 8
    store.close()


def test_the_sdk_splits_batches_into_requests_the_server_accepts(tmp_path):
    """client_config tells the SDK how to chunk a forward_backward: run the SDK's own chunker on a big batch
    and check every chunk against the server's caps."""
    from types import SimpleNamespace

    import numpy as np
    from tinker import types as T
    from tinker.lib.public_interfaces.training_client import TrainingClient

    from tx.engine.ops import RequestTooLarge

    app, engine, store = make_app(tmp_path, max_pass_datums=50, max_request_tokens=2000, max_pass_tokens=4000)
    with TestClient(app, headers={"X-API-Key": KEY}) as c:
        config = T.ClientConfigResponse.model_validate(c.post("/api/v1/client/config", json={}).json())
    store.close()
    rng = np.random.default_rng(1)
    data = [T.Datum(model_input=T.ModelInput.from_ints([1] * n), loss_fn_inputs={
        "target_tokens": [1] * n, "weights": [1.0] * n}) for n in rng.integers(1, 400, 300)]
    holder = SimpleNamespace(holder=SimpleNamespace(_client_config=config))
    chunks = list(TrainingClient._chunked_requests_generator(holder, data))
    assert sum(len(ch.data) for ch in chunks) == 300
    for ch in chunks:
        engine.check_pass_size(len(ch.data), sum(d.model_input.length for d in ch.data))
    with pytest.raises(RequestTooLarge, match="max_request_tokens=2000"):
        engine.check_pass_size(1, 2001)
