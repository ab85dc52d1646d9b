"""Tenant isolation (issue 12, defects 1, 3 and 20) through raw HTTP against the in-process app over a real
SQLite store and an engine whose thread is not started (requests stay queued, so nothing runs).

Two tenants, alice and bob, build the same things; then every route is called by bob on his own ids
(accepted) and on alice's (404, the very answer an unknown id gets, so ids do not leak), and alice's work is
checked untouched. The SDK flows against a real server are in test_isolation_sdk.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from tests.api.sdk_flows import fb_body
from tx.api.app import ApiConfig, ServedModel, create_app
from tx.engine.engine import Engine, EngineConfig
from tx.engine.store import Store

ALICE, BOB, ADMIN = "tml-alice-key", "tml-bob-key", "tml-admin-key"
FAKE_SESSION = "sess-0123456789abcdef"  # a well-formed id that was never created


def never(_output):
    raise AssertionError("nothing runs: the engine thread is not started")


@dataclass
class Ids:
    session: str
    model: str
    sampler: str
    request: str
    weights: str  # tinker:// path of a training checkpoint
    sampler_weights: str  # tinker:// path of a sampler checkpoint

    def replace_in(self, text: str, other: Ids) -> str:
        """`text` with these ids put in place of `other`'s (longest first: a model id contains its session's)."""
        pairs = sorted(zip(vars(other).values(), vars(self).values()), key=lambda p: -len(p[0]))
        for old, new in pairs:
            text = text.replace(old, new)
        return text


def make_app(tmp_path: Path, **config) -> tuple[TestClient, Store, Engine]:
    store = Store(f"sqlite:///{tmp_path / 'tx.sqlite'}")
    engine = Engine(None, store, EngineConfig(checkpoint_root=str(tmp_path)), "tiny", never, never)
    served = ServedModel(model_name="tiny", aliases=["tiny"], tokenizer_id="tiny", arch="Qwen3ForCausalLM",
                         max_context_length=128, max_lora_rank=8, max_num_samples=8)
    app = create_app(engine, store, ApiConfig(long_poll_s=0.1, **config), served)
    return TestClient(app), store, engine


def call(client: TestClient, key: str, method: str, path: str, body=None, **kw):
    headers = {"X-API-Key": key, **kw.pop("headers", {})}
    if isinstance(body, bytes):
        return client.request(method, path, content=body, headers=headers, **kw)
    return client.request(method, path, json=body, headers=headers, **kw)


def ok(r):
    assert r.status_code == 200, r.text
    return r.json()


def build(client: TestClient, store: Store, key: str) -> Ids:
    """A tenant's session, model (with a queued create future), checkpoints and a sampling session."""
    session = ok(call(client, key, "POST", "/api/v1/create_session", {"tags": []}))["session_id"]
    created = ok(call(client, key, "POST", "/api/v1/create_model", {
        "session_id": session, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}}))
    model = created["model_id"]
    # checkpoints as the engine records them (it would after save_weights / save_weights_for_sampler)
    store.put_checkpoint(model, "weights", "w1", f"/nowhere/{model}/w1", None, 1, {})
    store.put_checkpoint(model, "sampler_weights", "s1", f"/nowhere/{model}/s1.tar.gz", None, 1, {})
    sampler_weights = f"tinker://{model}/sampler_weights/s1"
    sampler = ok(call(client, key, "POST", "/api/v1/create_sampling_session", {
        "session_id": session, "sampling_session_seq_id": 0, "model_path": sampler_weights}))["sampling_session_id"]
    return Ids(session, model, sampler, created["request_id"], f"tinker://{model}/weights/w1", sampler_weights)


FAKE = Ids(FAKE_SESSION, f"{FAKE_SESSION}:train:0", f"{FAKE_SESSION}:sample:0", "req-" + "0" * 32,
           f"tinker://{FAKE_SESSION}:train:0/weights/w1", f"tinker://{FAKE_SESSION}:train:0/sampler_weights/s1")

PROMPT = {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]}
TOKENS = np.arange(10).reshape(2, 5)
PROTO = {"Content-Type": "application/x-protobuf"}

# route -> (method, path, body) from (target ids, the caller's own ids); bob's own call must be accepted
# with the given status, alice's ids must answer exactly as unknown ids do.
ROUTES = {
    "create_model": lambda t, me: ("POST", "/api/v1/create_model", {
        "session_id": t.session, "model_seq_id": 5, "base_model": "tiny", "lora_config": {"rank": 4}}),
    "load_weights into session": lambda t, me: ("POST", "/api/v1/load_weights", {
        "session_id": t.session, "model_seq_id": 6, "path": me.weights}),
    "load_weights from checkpoint": lambda t, me: ("POST", "/api/v1/load_weights", {
        "session_id": me.session, "model_seq_id": 6, "path": t.weights}),
    "load_weights into model": lambda t, me: ("POST", "/api/v1/load_weights", {
        "model_id": t.model, "seq_id": 1, "path": me.weights}),
    "load_weights into model from checkpoint": lambda t, me: ("POST", "/api/v1/load_weights", {
        "model_id": me.model, "seq_id": 1, "path": t.weights}),
    "forward_backward": lambda t, me: ("POST", "/api/v1/forward_backward", fb_body(t.model, 1, TOKENS)),
    "forward": lambda t, me: ("POST", "/api/v1/forward_backward", fb_body(t.model, 1, TOKENS, forward_only=True)),
    "optim_step": lambda t, me: ("POST", "/api/v1/optim_step", {"model_id": t.model, "seq_id": 1, "adam_params": {}}),
    "save_weights": lambda t, me: ("POST", "/api/v1/save_weights", {"model_id": t.model, "seq_id": 1, "path": "x"}),
    "save_weights_for_sampler": lambda t, me: ("POST", "/api/v1/save_weights_for_sampler", {
        "model_id": t.model, "seq_id": 1, "sampling_session_seq_id": 1}),
    "save_weights_external": lambda t, me: ("POST", "/api/v1/save_weights_external", {
        "model_id": t.model, "seq_id": 1, "path": "x"}),
    "unload_model": lambda t, me: ("POST", "/api/v1/unload_model", {"model_id": t.model}),
    "get_info": lambda t, me: ("POST", "/api/v1/get_info", {"model_id": t.model}),
    "retrieve_future": lambda t, me: ("POST", "/api/v1/retrieve_future", {"request_id": t.request}),
    "session_heartbeat": lambda t, me: ("POST", "/api/v1/session_heartbeat", {"session_id": t.session}),
    "get_session": lambda t, me: ("GET", f"/api/v1/sessions/{t.session}", None),
    "finish_session": lambda t, me: ("POST", f"/api/v1/sessions/{t.session}/finish", {}),
    "get_sampler": lambda t, me: ("GET", f"/api/v1/samplers/{t.sampler}", None),
    "create_sampling_session in session": lambda t, me: ("POST", "/api/v1/create_sampling_session", {
        "session_id": t.session, "sampling_session_seq_id": 3, "base_model": "tiny"}),
    "create_sampling_session from checkpoint": lambda t, me: ("POST", "/api/v1/create_sampling_session", {
        "session_id": me.session, "sampling_session_seq_id": 3, "model_path": t.sampler_weights}),
    "asample via sampling session": lambda t, me: ("POST", "/api/v1/asample", {
        "sampling_session_id": t.sampler, "seq_id": 0, "prompt": PROMPT, "num_samples": 1,
        "sampling_params": {"max_tokens": 2}}),
    "asample via model_path": lambda t, me: ("POST", "/api/v1/asample", {
        "model_path": t.sampler_weights, "prompt": PROMPT, "num_samples": 1, "sampling_params": {"max_tokens": 2}}),
    "weights_info": lambda t, me: ("POST", "/api/v1/weights_info", {"tinker_path": t.weights}),
    "get_training_run": lambda t, me: ("GET", f"/api/v1/training_runs/{t.model}", None),
    "list_run_checkpoints": lambda t, me: ("GET", f"/api/v1/training_runs/{t.model}/checkpoints", None),
    "set_checkpoint_ttl": lambda t, me: ("PUT", f"/api/v1/training_runs/{t.model}/checkpoints/weights/w1/ttl",
                                         {"ttl_seconds": 100}),
    "delete_checkpoint": lambda t, me: ("DELETE", f"/api/v1/training_runs/{t.model}/checkpoints/weights/w1", None),
}
ROUTES.update({
    "publish_checkpoint": lambda t, me: ("POST", f"/api/v1/training_runs/{t.model}/checkpoints/weights/w1/publish", None),
    "unpublish_checkpoint": lambda t, me: ("DELETE", f"/api/v1/training_runs/{t.model}/checkpoints/weights/w1/publish",
                                           None),
})
OWN_STATUS = {"unpublish_checkpoint": 409}  # the owner's own is private already: a conflict, after the owner check


@pytest.fixture
def tenants(tmp_path):
    client, store, engine = make_app(tmp_path, api_keys=[ALICE, BOB], admin_api_keys=[ADMIN])
    with client:
        alice, bob = build(client, store, ALICE), build(client, store, BOB)
        yield client, store, engine, alice, bob
    store.close()


def alice_untouched(store: Store, engine: Engine, alice: Ids) -> None:
    assert store.session(alice.session)["status"] == "active"
    assert store.model(alice.model)["status"] == "creating"
    assert store.checkpoint(alice.model, "weights", "w1")["expires_at"] is None
    assert sorted(engine.scheduler.models[alice.model].waiting) == [0]  # only her own create_model
    assert engine.queued_samples() == 0 or all(op.payload.location != f"/nowhere/{alice.model}/s1.tar.gz"
                                               for op in engine.scheduler.samples)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_route_answers_404_for_another_tenants_ids(tenants, route):
    client, store, engine, alice, bob = tenants
    method, path, body = ROUTES[route](alice, bob)
    theirs = call(client, BOB, method, path, body, headers=PROTO if isinstance(body, bytes) else {})
    method, path, body = ROUTES[route](FAKE, bob)
    unknown = call(client, BOB, method, path, body, headers=PROTO if isinstance(body, bytes) else {})
    assert theirs.status_code == unknown.status_code == 404, (theirs.text, unknown.text)
    assert FAKE.replace_in(theirs.json()["detail"], alice) == unknown.json()["detail"]
    alice_untouched(store, engine, alice)
    method, path, body = ROUTES[route](bob, bob)  # the same call on bob's own ids is accepted
    mine = call(client, BOB, method, path, body, headers=PROTO if isinstance(body, bytes) else {})
    assert mine.status_code == OWN_STATUS.get(route, 200), mine.text
    method, path, body = ROUTES[route](alice, alice)  # ...and alice's on hers, unless bob's call ended it
    if route not in ("delete_checkpoint", "finish_session", "unload_model"):
        assert call(client, ALICE, method, path, body, headers=PROTO if isinstance(body, bytes) else {}).status_code \
            == OWN_STATUS.get(route, 200)


def test_listings_show_only_ones_own_and_admin_sees_all(tenants):
    client, store, _, alice, bob = tenants
    legacy = store.create_session([], {}, None, None)  # as migrated from schema 1: nobody's
    for key, ids in ((ALICE, alice), (BOB, bob)):
        assert ok(call(client, key, "GET", "/api/v1/sessions"))["sessions"] == [ids.session]
        runs = ok(call(client, key, "GET", "/api/v1/training_runs"))
        assert [r["training_run_id"] for r in runs["training_runs"]] == [ids.model]
        assert runs["cursor"]["total_count"] == 1
        ckpts = ok(call(client, key, "GET", "/api/v1/checkpoints"))
        assert sorted(c["tinker_path"] for c in ckpts["checkpoints"]) == sorted([ids.weights, ids.sampler_weights])
        assert ok(call(client, key, "GET", f"/api/v1/sessions/{ids.session}"))["sampler_ids"] == [ids.sampler]
    assert ok(call(client, ADMIN, "GET", "/api/v1/sessions"))["sessions"] == [legacy, bob.session, alice.session]
    assert ok(call(client, ADMIN, "GET", "/api/v1/training_runs"))["cursor"]["total_count"] == 2
    assert ok(call(client, ADMIN, "GET", "/api/v1/checkpoints"))["cursor"]["total_count"] == 4
    assert ok(call(client, ADMIN, "POST", "/api/v1/get_info", {"model_id": alice.model}))["lora_rank"] == 4
    assert call(client, BOB, "GET", f"/api/v1/sessions/{legacy}").status_code == 404


@pytest.mark.parametrize("query, message", [
    ("limit=-1", "limit -1 must be between 1 and 1000"), ("limit=0", "limit 0 must be between 1 and 1000"),
    ("limit=1001", "limit 1001 must be between 1 and 1000"), ("offset=-1", "offset -1 must be >= 0")])
@pytest.mark.parametrize("path", ["/api/v1/sessions", "/api/v1/training_runs", "/api/v1/checkpoints"])
def test_listing_bounds(tenants, path, query, message):
    client = tenants[0]
    r = call(client, ALICE, "GET", f"{path}?{query}")
    assert r.status_code == 400 and r.json()["detail"] == message
    assert call(client, ALICE, "GET", f"{path}?limit=1000&offset=0").status_code == 200


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/no-such-path"])
def test_docs_and_schema_need_a_key(tenants, path):
    client = tenants[0]
    for key in ("", "tml-wrong"):
        r = call(client, key, "GET", path)
        assert r.status_code == 401 and r.json()["detail"] == "missing or unknown X-API-Key"
    assert call(client, BOB, "GET", path).status_code == (404 if path == "/no-such-path" else 200)
    assert call(client, "", "GET", "/api/v1/healthz").status_code == 200


def test_keys_are_stored_hashed(tenants, tmp_path):
    client, store, _, alice, _ = tenants
    digest = hashlib.sha256(ALICE.encode()).hexdigest()
    assert store.session(alice.session)["owner"] == digest
    assert store.model(alice.model)["owner"] == digest
    assert store.future(alice.request).owner == digest
    assert store.checkpoint(alice.model, "weights", "w1")["owner"] == digest
    assert store.sampling_session(alice.sampler)["owner"] == digest
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("tx.sqlite*"))  # the database, its WAL included
    assert digest.encode() in raw
    assert ALICE.encode() not in raw and BOB.encode() not in raw and ADMIN.encode() not in raw


def test_deleted_checkpoint_is_refused_by_its_sampling_session(tenants):
    """Defect 20 (API side): a sampling session opened on a checkpoint stops sampling once it is deleted."""
    client, _, engine, alice, _ = tenants
    body = ROUTES["asample via sampling session"](alice, alice)[2]
    assert call(client, ALICE, "POST", "/api/v1/asample", body).status_code == 200
    ok(call(client, ALICE, "DELETE", f"/api/v1/training_runs/{alice.model}/checkpoints/sampler_weights/s1"))
    r = call(client, ALICE, "POST", "/api/v1/asample", {**body, "seq_id": 1})
    assert r.status_code == 404 and alice.sampler_weights in r.json()["detail"], r.text
    assert engine.queued_samples() == 1  # only the sample from before the delete


def test_without_auth_each_key_is_a_tenant(tmp_path):
    client, store, _ = make_app(tmp_path, no_auth=True)
    with client:
        x, y = build(client, store, "any-x"), build(client, store, "any-y")
        assert call(client, "any-y", "GET", f"/api/v1/sessions/{x.session}").status_code == 404
        assert call(client, "", "GET", f"/api/v1/training_runs/{y.model}").status_code == 404
        assert ok(call(client, "any-x", "GET", "/api/v1/sessions"))["sessions"] == [x.session]
        assert ok(call(client, "", "GET", "/api/v1/sessions"))["sessions"] == []  # no key: a tenant of its own
    store.close()
