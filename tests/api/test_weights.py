"""Weights in and out through the official SDK and tinker-cookbook's `weights.download`, against a real
`python -m tx.run`: save_weights_external, signed download URLs, publish / unpublish, copy_weights.

The reference is PEFT + transformers: a downloaded adapter loaded onto the tiny HF checkpoint must give
tx's log-probs (1e-4)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types as T

from tests.api import sdk_flows
from tests.api.server_proc import API_KEY, CLIENTS, Server
from tests.helpers import hf_logprobs
from tests.require import require_module
from tx.api.weights_routes import UrlSigner

weights = require_module("tinker_cookbook.weights")
peft = require_module("peft")
pytestmark = pytest.mark.slow
BOB = "tml-bob-weights-key"
SIGNING_KEY = "weights-test-signing-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_dirs):
    srv = Server(tmp_path_factory.mktemp("weights"), "--api-key", BOB, "--url-signing-key", SIGNING_KEY,
                 base_model=tiny_dirs["dense"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def trained(server, tiny_dirs):
    """alice's run after two SFT steps: (training client, state path, external weights path)."""
    sc = client(server.url, API_KEY)
    tc = sc.create_lora_training_client(base_model=tiny_dirs["dense"], rank=4, seed=1).result()
    sdk_flows.train_steps(tc, sdk_flows.datums(0), 2)
    state = tc.save_state("w1").result().path
    ext = tc.save_weights_external("final").result().path
    return tc, state, ext


def client(url: str, key: str) -> tinker.ServiceClient:
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    CLIENTS.setdefault(url, []).append(sc)
    return sc


def rest(url: str, key: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=url, api_key=key)


def download(monkeypatch, server: Server, key: str, path: str, out: Path) -> Path:
    """The cookbook's download with `key` in TINKER_API_KEY, in a process of its own: the SDK shares one
    REST client per (URL, key argument) in a process, so a second key from the environment would not apply."""
    env = {**os.environ, "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0"}
    code = "import sys; from tinker_cookbook import weights; weights.download(tinker_path=sys.argv[1], " \
           "output_dir=sys.argv[2], base_url=sys.argv[3])"
    done = subprocess.run([sys.executable, "-c", code, path, str(out), server.url], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def peft_logprobs(tiny_dir: str, adapter: Path, data: list[T.Datum]) -> np.ndarray:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32), str(adapter))
    ids = np.array([d.model_input.to_ints() for d in data])
    targets = np.array([d.loss_fn_inputs["target_tokens"].tolist() for d in data])
    return hf_logprobs(model, ids, np.ones_like(ids), targets)


def load_status(server: Server, key: str, path: str) -> int:
    """HTTP status of creating a training run from `path` with `key` (raw: the SDK retries a refused load
    for minutes before it gives up)."""
    headers = {"X-API-Key": key}
    session = httpx.post(f"{server.url}/api/v1/create_session", json={"tags": [], "sdk_version": "test"},
                         headers=headers).json()["session_id"]
    return httpx.post(f"{server.url}/api/v1/load_weights", json={"path": path, "session_id": session,
                                                                "model_seq_id": 0}, headers=headers).status_code


def publish_status(server: Server, method: str, path: str) -> int:
    model_id, kind, name = path[len("tinker://"):].split("/")
    url = f"{server.url}/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/publish"
    return httpx.request(method, url, headers={"X-API-Key": API_KEY}).status_code


def file_bytes(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_downloaded_adapter_loads_in_peft_and_matches(server, trained, tiny_dirs, tmp_path, monkeypatch):
    tc, state, ext = trained
    data = sdk_flows.datums(7, rows=2)
    want = sdk_flows.logprobs_of(tc.forward(data, "cross_entropy").result())
    # external weights: one signed URL per file of the PEFT directory
    plain = download(monkeypatch, server, API_KEY, ext, tmp_path / "ext")
    assert sorted(file_bytes(plain)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert np.abs(peft_logprobs(tiny_dirs["dense"], plain, data) - want).max() <= 1e-4
    # a training checkpoint: the cookbook loads it into a new run, exports it age-encrypted to a one-off key,
    # downloads, decrypts and deletes the export
    via_state = download(monkeypatch, server, API_KEY, state, tmp_path / "state")
    assert file_bytes(via_state)["adapter_model.safetensors"] == file_bytes(plain)["adapter_model.safetensors"]
    listed = {c.checkpoint_id for c in rest(server.url, API_KEY).list_user_checkpoints().result().checkpoints}
    assert "external_weights/download" not in listed and "external_weights/final" in listed
    with pytest.raises(tinker.BadRequestError, match=r"age_encryption_recipients\[0\] = 'age1nope'"):
        tc.save_weights_external("bad", age_encryption_recipients=["age1nope"]).result()


def test_signed_urls_refuse_tampering_and_expiry(server, trained):
    _, _, ext = trained
    urls = rest(server.url, API_KEY).get_external_weights_urls(ext).result()
    url = urls.urls["adapter_config.json"]
    assert url.startswith(server.url + "/api/v1/weights_files/")
    ok = httpx.get(url, timeout=30)  # no API key: the signature is the authority
    assert ok.status_code == 200 and b'"peft_type": "LORA"' in ok.content
    tampered = {"signature": url[:-1] + ("0" if url[-1] != "0" else "1"),
                "file": url.replace("adapter_config.json", "adapter_model.safetensors"),
                "expiry": url.replace("expires=", "expires=9")}
    for what, bad in tampered.items():
        r = httpx.get(bad, timeout=30)
        assert r.status_code == 403 and "signature does not match" in r.json()["detail"], (what, r.text)
    model_id, _, name = ext[len("tinker://"):].split("/")
    past = int(time.time()) - 5
    expired = server.url + UrlSigner(SIGNING_KEY).path(model_id, name, "adapter_config.json", past, False)
    r = httpx.get(expired, timeout=30)
    assert r.status_code == 403 and "expired" in r.json()["detail"], r.text
    assert httpx.get(expired.replace("/api/v1/weights_files/", "/api/v1/weights_filez/"), timeout=30).status_code == 401


def test_publish_lets_other_tenants_read_until_unpublished(server, trained, tmp_path, monkeypatch):
    tc, state, ext = trained
    alice, bob = rest(server.url, API_KEY), rest(server.url, BOB)
    bob_sc = client(server.url, BOB)
    with pytest.raises(tinker.NotFoundError):
        bob.get_external_weights_urls(ext).result()
    assert load_status(server, BOB, state) == 404

    alice.publish_checkpoint_from_tinker_path(ext).result()
    alice.publish_checkpoint_from_tinker_path(state).result()
    # already public: 409 as the SDK documents (raw: the SDK retries a 409 for minutes)
    assert publish_status(server, "post", state) == 409
    assert {c.checkpoint_id: c.public for c in alice.list_checkpoints(tc.model_id).result().checkpoints} == {
        "weights/w1": True, "external_weights/final": True}
    # bob reads: weights info, URLs, the files, and a training run of his own from alice's state
    assert bob.get_weights_info_by_tinker_path(state).result().lora_rank == 4
    bob_urls = bob.get_external_weights_urls(ext).result().urls
    mine = alice.get_external_weights_urls(ext).result().urls
    assert {k: httpx.get(u).content for k, u in bob_urls.items()} == {k: httpx.get(u).content for k, u in mine.items()}
    bob_tc = bob_sc.create_training_client_from_state(state).result()
    data = sdk_flows.datums(3, rows=2)
    np.testing.assert_allclose(sdk_flows.logprobs_of(bob_tc.forward(data, "cross_entropy").result()),
                               sdk_flows.logprobs_of(tc.forward(data, "cross_entropy").result()), atol=1e-6)
    download(monkeypatch, server, BOB, state, tmp_path / "bob")  # the cookbook, with bob's key
    # ...but nothing else: no listing, no publish/unpublish/delete/ttl of alice's checkpoints
    assert bob.list_user_checkpoints().result().checkpoints == [] or all(
        not c.tinker_path.startswith(f"tinker://{tc.model_id}/") for c in bob.list_user_checkpoints().result().checkpoints)
    for call in (bob.unpublish_checkpoint_from_tinker_path, bob.publish_checkpoint_from_tinker_path,
                 bob.delete_checkpoint_from_tinker_path):
        with pytest.raises(tinker.NotFoundError):
            call(state).result()
    with pytest.raises(tinker.NotFoundError):
        bob.set_checkpoint_ttl_from_tinker_path(state, 7200).result()

    alice.unpublish_checkpoint_from_tinker_path(ext).result()
    alice.unpublish_checkpoint_from_tinker_path(state).result()
    assert publish_status(server, "delete", state) == 409
    with pytest.raises(tinker.NotFoundError):
        bob.get_external_weights_urls(ext).result()
    assert load_status(server, BOB, state) == 404
    revoked = httpx.get(bob_urls["adapter_config.json"])  # the URL bob was given is dead at once
    assert revoked.status_code == 404 and "no longer published" in revoked.json()["detail"]
    assert httpx.get(mine["adapter_config.json"]).status_code == 200  # alice's own still work


def test_copy_weights_shares_equal_bytes(server, trained):
    tc, state, ext = trained
    alice, bob = rest(server.url, API_KEY), rest(server.url, BOB)
    root = server.log_path.parent / "checkpoints"

    def current(path: str) -> Path:
        model_id, kind, name = path[len("tinker://"):].split("/")
        d = root / model_id / kind / name
        return d / (d / "LATEST").read_text().strip()

    copied = alice.copy_weights(state, "proj-archive").result()
    assert copied != state and copied.endswith("/weights/w1")
    assert file_bytes(current(copied)) == file_bytes(current(state))
    run = alice.get_training_run_by_tinker_path(copied).result()
    assert run.user_metadata["copied_from"] == state and run.lora_rank == 4
    loaded = client(server.url, API_KEY).create_training_client_from_state(copied).result()
    data = sdk_flows.datums(5, rows=2)
    np.testing.assert_allclose(sdk_flows.logprobs_of(loaded.forward(data, "cross_entropy").result()),
                               sdk_flows.logprobs_of(tc.forward(data, "cross_entropy").result()), atol=1e-6)
    ext_copy = alice.copy_weights(ext, "proj-archive", ttl_seconds=7200).result()
    assert file_bytes(current(ext_copy)) == file_bytes(current(ext))
    # deleting the source leaves the copy whole (hard links, not shared names)
    alice.delete_checkpoint_from_tinker_path(ext_copy).result()
    assert file_bytes(current(ext))
    # a retry with the same idempotency key is the same copy; another key, another copy
    body = {"source_path": state, "destination_project_id": "p"}
    first = httpx.post(f"{server.url}/api/v1/copy_weights", json=body,
                       headers={"X-API-Key": API_KEY, "X-Idempotency-Key": "k1"}).json()["tinker_path"]
    again = httpx.post(f"{server.url}/api/v1/copy_weights", json=body,
                       headers={"X-API-Key": API_KEY, "X-Idempotency-Key": "k1"}).json()["tinker_path"]
    assert first == again != copied
    # bob can copy only what alice published; his copy is his
    with pytest.raises(tinker.NotFoundError):
        bob.copy_weights(state, "bob-proj").result()
    alice.publish_checkpoint_from_tinker_path(state).result()
    try:
        bobs = bob.copy_weights(state, "bob-proj").result()
    finally:
        alice.unpublish_checkpoint_from_tinker_path(state).result()
    assert file_bytes(current(bobs)) == file_bytes(current(state))
    assert bobs in {c.tinker_path for c in bob.list_user_checkpoints().result().checkpoints}
    with pytest.raises(tinker.BadRequestError, match="weights_access_token"):
        alice.copy_weights(state, "p", weights_access_token="t").result()
    key_hash = hashlib.sha256(API_KEY.encode()).hexdigest()
    assert key_hash not in first  # copy ids do not reveal the tenant
