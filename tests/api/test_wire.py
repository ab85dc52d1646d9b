"""Crafted protobuf forward_backward bodies and out-of-range JSON values: each is a 400 naming the field
and the value that still takes its seq_id, so the model's next request runs at once (the gap timeout here
is far longer than the test). The app runs in-process over a real engine thread and JAX backend."""

from __future__ import annotations

import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tinker.proto import tinker_public_pb2 as pb

import tx
from tx.api import wire
from tx.api.app import ApiConfig, ServedModel, create_app
from tx.engine.engine import Engine, EngineConfig
from tx.engine.store import Store

KEY = "tml-wire-test"
ADMIN_KEY = "tml-wire-test-admin"  # reads /api/v1/metrics (server-wide counters)
TOKENS = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def backend(tiny_dirs):
    return tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(max_lora_adapters=2, max_lora_rank=4, max_seq_len=32))


@pytest.fixture
def client(tmp_path, backend):
    store = Store(f"sqlite:///{tmp_path / 'tx.sqlite'}")
    engine = Engine(backend, store, EngineConfig(checkpoint_root=str(tmp_path / "ck"), seq_gap_timeout_s=3600),
                    "tiny", wire.encode_pass, wire.encode_sample)
    served = ServedModel(model_name="tiny", aliases=["tiny"], tokenizer_id="tiny", arch="Qwen3ForCausalLM",
                         max_context_length=32, max_lora_rank=4, max_num_samples=4)
    engine.start()
    with TestClient(create_app(engine, store, ApiConfig(api_keys=[KEY], admin_api_keys=[ADMIN_KEY], long_poll_s=5),
                               served),
                    headers={"X-API-Key": KEY}) as c:
        session = c.post("/api/v1/create_session", json={}).json()["session_id"]
        created = c.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                        "base_model": "tiny", "lora_config": {"rank": 4}}).json()
        c.model_id = created["model_id"]
        assert result(c, created["request_id"], 60)["model_id"] == c.model_id
        yield c
    engine.stop()
    for model_id in list(backend.models):  # one slot: free it for the next test
        backend.delete_model(model_id)
    store.close()


def result(c: TestClient, request_id: str, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = c.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith(wire.PROTO):
            return r.content
        if r.json().get("type") != "try_again":
            return r.json()
    raise AssertionError(f"future {request_id} did not finish in {timeout} s: a seq_id gap was not consumed")


def body(model_id: str, seq_id: int, target: pb.Tensor | None = None, forward_only: bool = True) -> bytes:
    """A ForwardBackwardRequest built with the SDK's generated classes; `target` replaces the well-formed
    target_tokens tensor."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy",
                                    forward_only=forward_only)
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(TOKENS, np.int32).tobytes()
    good = pb.Tensor(dense=np.asarray(TOKENS[1:] + [9], np.int64).tobytes(), dtype=pb.DTYPE_INT64, shape=[4])
    datum.loss_fn_inputs["target_tokens"].CopyFrom(target if target is not None else good)
    return msg.SerializeToString()


def _csr(shape, crow, col, values) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, sparse_csr=pb.SparseCsr(
        values=np.asarray(values, np.float32).tobytes(), crow_indices=np.asarray(crow, np.int64).tobytes(),
        col_indices=np.asarray(col, np.int64).tobytes()))


WHERE = "data[0].loss_fn_inputs['target_tokens']"
CRAFTED = {  # name: (target_tokens tensor, what the 400 must say)
    "2^32 x 2^32": (pb.Tensor(dtype=pb.DTYPE_INT64, shape=[2**32, 2**32]), "shape [4294967296, 4294967296]"),
    "negative dims": (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-1, -4], dense=np.zeros(4, np.float32).tobytes()),
                      "shape [-1, -4] has a negative dimension"),
    "sparse 1 x 10^13": (_csr([1, 10**13], [0, 1], [10**13 - 1], [1.0]), "sparse CSR shape [1, 10000000000000]"),
    "2^63 - 1": (pb.Tensor(dtype=pb.DTYPE_INT64, shape=[2**63 - 1]), "shape [9223372036854775807]"),
    "shape without data": (pb.Tensor(dtype=pb.DTYPE_INT64, shape=[4]), "has 0 entries but model_input has 4"),
    "2-D of the right size": (pb.Tensor(dtype=pb.DTYPE_INT64, shape=[2, 2], dense=np.zeros(4, np.int64).tobytes()),
                              "shape [2, 2]; tx takes [4] or [4, K] here"),
    "2-D with a huge K": (pb.Tensor(dtype=pb.DTYPE_INT64, shape=[4, 10**13]), "K must be between 1 and 128"),
    "sparse 2-D, column out of range": (_csr([4, 3], [0, 1, 1, 1, 1], [3], [1.0]), "col_indices must be in [0, 3)"),
    "sparse 2-D, bad row offsets": (_csr([4, 3], [0, 2, 1, 1, 1], [0], [1.0]), "crow_indices must be 5 non-decreasing"),
    "ragged bytes": (pb.Tensor(dtype=pb.DTYPE_INT64, shape=[4], dense=b"\0" * 31), "31 bytes is not a whole number"),
    "unknown dtype": (pb.Tensor(dtype=77, shape=[4], dense=b"\0" * 32), "unsupported dtype 77"),
}


def test_crafted_tensor_shapes_are_400s_that_consume_the_seq_id(client):
    for seq_id, (name, (tensor, says)) in enumerate(CRAFTED.items(), start=1):
        r = client.post("/api/v1/forward_backward", content=body(client.model_id, seq_id, tensor),
                        headers={"Content-Type": wire.PROTO})
        assert r.status_code == 400, (name, r.status_code, r.text)
        assert WHERE in r.json()["detail"] and says in r.json()["detail"], (name, r.json())
    # the next seq_id runs now, not after the gap timeout (an hour)
    nxt = client.post("/api/v1/forward_backward", content=body(client.model_id, len(CRAFTED) + 1),
                      headers={"Content-Type": wire.PROTO})
    assert nxt.status_code == 200, nxt.text
    out = result(client, nxt.json()["request_id"], 60)
    assert isinstance(out, bytes) and len(out) > 0  # a ForwardBackwardOutput protobuf


def test_metrics_count_pass_requests_per_loss_function(client):
    """/api/v1/metrics names the loss of every pass request that ran (refused ones are not counted)."""
    sent = [(1, TARGET_2D, True), (2, None, False), (3, None, False)]  # (seq_id, target, forward_only)
    for seq_id, target, forward_only in sent:
        r = client.post("/api/v1/forward_backward", content=body(client.model_id, seq_id, target, forward_only),
                        headers={"Content-Type": wire.PROTO})
        assert r.status_code == (400 if target is TARGET_2D else 200), r.text
        if r.status_code == 200:
            result(client, r.json()["request_id"], 60)
    engine = client.get("/api/v1/metrics", headers={"X-API-Key": ADMIN_KEY}).json()["engine"]
    assert engine.get("forward_requests_cross_entropy", 0) == 0, engine
    assert engine["forward_backward_requests_cross_entropy"] == 2, engine


TARGET_2D = CRAFTED["2-D of the right size"][0]


@pytest.mark.parametrize("route, extra", [("save_weights", {"path": "ck"}),
                                          ("save_weights_for_sampler", {"path": "ck"})])
@pytest.mark.parametrize("ttl, says", [(10**400, "ttl_seconds (an integer of 1329 bits)"),
                                       (0, "ttl_seconds 0"), (11 * 365 * 24 * 3600, "ttl_seconds 346896000"),
                                       (2.5, "ttl_seconds 2.5")],
                         ids=["10^400", "zero", "eleven-years", "fraction"])
def test_bad_ttl_is_a_400_that_consumes_the_seq_id(client, route, extra, ttl, says):
    raw = '{"model_id": "%s", "seq_id": 1, "path": "ck", "ttl_seconds": %s}' % (client.model_id, ttl)
    r = client.post(f"/api/v1/{route}", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and says in r.json()["detail"] and "[1, 315360000]" in r.json()["detail"], r.text
    step = client.post("/api/v1/optim_step", json={"model_id": client.model_id, "seq_id": 2,
                                                   "adam_params": {"learning_rate": 1e-4}})
    assert step.status_code == 200, step.text
    assert "metrics" in result(client, step.json()["request_id"], 60)


def test_checkpoint_ttl_route_bounds_ttl(client):
    r = client.put(f"/api/v1/training_runs/{client.model_id}/checkpoints/weights/x/ttl",
                   content='{"ttl_seconds": %d}' % 10**400, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "ttl_seconds" in r.json()["detail"], r.text


def test_valid_ttl_is_kept(client):
    r = client.post("/api/v1/save_weights", json={"model_id": client.model_id, "seq_id": 1, "path": "keep",
                                                  "ttl_seconds": 3600})
    assert r.status_code == 200, r.text
    assert result(client, r.json()["request_id"], 60)["path"].endswith("/weights/keep")
    rows = client.get(f"/api/v1/training_runs/{client.model_id}/checkpoints").json()["checkpoints"]
    expires = [row.get("expires_at") for row in rows]
    assert len(rows) == 1 and expires[0] is not None, rows


def test_sample_response_carries_prompt_cache_hit_tokens():
    from tx import types

    out = types.SampleOutput(sequences=[types.GeneratedSequence(tokens=[3, 4], logprobs=[-0.5, -1.0],
                                                                stop_reason="length")], prompt_cache_hit_tokens=12)
    _, data = wire.encode_sample(out)
    msg = pb.SampleResponse.FromString(data)
    assert msg.prompt_cache_hit_tokens == 12 and len(msg.sequences) == 1


@tx.losses.register("test_wire_extra", input_keys=("ref_logprobs",), replace=True)
def _wire_extra(tlp, inputs, config):
    return (tlp - inputs["ref_logprobs"]) ** 2


def test_extra_loss_inputs_of_registered_losses_are_decoded():
    """A loss_fn_inputs key that a registered loss declares reaches the datum as a float list; a key no loss
    declares is not decoded (it stays out of the backend, as before)."""
    msg = pb.ForwardBackwardRequest.FromString(body("m", 1))
    msg.loss_fn = "test_wire_extra"
    datum = msg.data[0]
    ref = np.asarray([-1.5, -2.0, -0.25, -3.0], np.float32)
    datum.loss_fn_inputs["ref_logprobs"].CopyFrom(pb.Tensor(dense=ref.tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[4]))
    datum.loss_fn_inputs["not_a_loss_input"].CopyFrom(pb.Tensor(dense=ref.tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[4]))
    decoded = wire.pass_request(msg).datums[0]
    assert decoded.extra_inputs == {"ref_logprobs": ref.astype(np.float64).tolist()}
    datum.loss_fn_inputs["ref_logprobs"].CopyFrom(pb.Tensor(dense=ref[:3].tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[3]))
    with pytest.raises(wire.UserError, match=r"loss_fn_inputs\['ref_logprobs'\]"):
        wire.pass_request(msg)
