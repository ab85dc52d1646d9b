"""The hostile-input matrix of issue 12: every case of tests/api/hostile_cases.py against one live server.

One in-process server (real SQLite store, engine thread, JAX backend on the tiny model, uvicorn on a
loopback port) holds three trained adapters: the victim (the attacker's own model, target of every bad
request), its twin (same seed, same training, same session) and a bystander (another key and session).
Each has gradient sums accumulated since an optim_step, so Adam state is non-zero. Per case:

- the answer is a 4xx, or an accepted request whose future ends failed, and its message names the field;
- the server keeps serving: the victim's next training request (seq_id + 1 when the bad request carried
  a readable seq_id, which a refusal must consume) finishes within PROBE_S, well before the seq gap
  timeout, and the engine thread is alive;
- the three adapters are bit-identical to before the case: LoRA weights and scales, gradient sums,
  accumulation counters, Adam moments and step count (read from the backend's device state).

An adapter that a case did change is restored from its training checkpoint before the next case, so
each case is judged on its own.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import jax
import numpy as np
import pytest
import uvicorn
from flax import nnx
from tinker.proto import tinker_public_pb2 as pb

from tests.api.hostile_cases import (CASES, FB, LOAD, MAX_BODY, MAX_DECOMPRESSED, MAX_SEQ_LEN, OPT, VOCAB, Case, Ctx,
                                     datum, ones, rl)
from tests.api.server_proc import free_port
from tx.api import wire
from tx.api.app import ApiConfig, create_app
from tx.api.server import served_model
from tx.backends.config import JaxBackendConfig
from tx.distributed.backend import DistributedBackend
from tx.engine.engine import Engine, EngineConfig
from tx.engine.store import Store
from tx.models.layers.lora import LoraA, LoraB, LoraScale
from tx.models.sharding import to_host

pytestmark = pytest.mark.slow
ATTACKER, BYSTANDER = "tml-hostile-attacker", "tml-hostile-bystander"
GAP_S = 6.0  # the engine's seq_gap_timeout_s
PROBE_S = 4.0  # the victim's next request must finish this fast (a seq_id left unconsumed costs GAP_S)
DONE_S = 120.0  # longest wait for a hostile request's future
SETUP = {"victim": (ATTACKER, 7, 0), "twin": (ATTACKER, 7, 0), "bystander": (BYSTANDER, 11, 1)}  # key, seed, data


def training_data(which: int) -> list[list[list[int]]]:
    """Two forward_backward batches (token sequences) per data set."""
    rng = np.random.default_rng(100 + which)
    return [[rng.integers(0, VOCAB, 12).tolist() for _ in range(2)] for _ in range(2)]


def adapter_state(backend: DistributedBackend, model_id: str) -> dict[str, np.ndarray]:
    """Everything that makes up one adapter, copied to numpy."""
    impl = backend.impl
    slot = impl.models[model_id].adapter_index
    _, lora, scales, _ = nnx.split(impl.model, (LoraA, LoraB), LoraScale, ...)
    state: dict[str, np.ndarray] = {}
    for path, v in nnx.to_flat_state(lora):
        state["weights." + ".".join(map(str, path))] = np.take(to_host(v.get_value()), slot, axis=-3)
    for path, v in nnx.to_flat_state(scales):
        state["scale." + ".".join(map(str, path))] = to_host(v.get_value())[..., slot]
    for name, g in impl.grad_sum_of(model_id).items():
        state["grad_sum." + name] = np.asarray(g)
    for path, leaf in jax.tree_util.tree_flatten_with_path(impl.opt_state_of(model_id))[0]:
        state["adam" + jax.tree_util.keystr(path)] = to_host(leaf)
    acc = impl._accumulated[model_id]
    state["accumulated"] = np.asarray([acc["sequences"], acc["tokens"]])
    state["optim_steps"] = np.asarray(impl.models[model_id].optim_steps)
    return state


def differences(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> list[str]:
    changed = sorted(set(before) ^ set(after))
    for key in sorted(set(before) & set(after)):
        a, b = before[key], after[key]
        nan_ok = a.dtype.kind in "fc"
        if a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b, equal_nan=nan_ok):
            changed.append(key)
    return changed


class World:
    def __init__(self, root: Path, model_dir: str):
        self.store = Store(f"sqlite:///{root / 'tx.sqlite'}")
        self.backend = DistributedBackend(model_dir, JaxBackendConfig(
            max_lora_adapters=16, max_lora_rank=8, max_seq_len=MAX_SEQ_LEN))
        served = served_model("tiny", Path(model_dir), None, self.backend)
        self.engine = Engine(self.backend, self.store, EngineConfig(
            checkpoint_root=str(root / "checkpoints"), seq_gap_timeout_s=GAP_S), served.model_name,
            wire.encode_pass, wire.encode_sample)
        app = create_app(self.engine, self.store, ApiConfig(
            api_keys=[ATTACKER, BYSTANDER], max_body_bytes=MAX_BODY, max_decompressed_bytes=MAX_DECOMPRESSED,
            long_poll_s=1.0), served)
        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    lifespan="off"))
        self.engine.start()
        self.thread = threading.Thread(target=self.server.run, name="hostile-uvicorn", daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        self.models: dict[str, str] = {}
        self.seq: dict[str, int] = {}
        self.outstanding: list[tuple[str, str]] = []  # (request_id, key) left pending by a timed-out probe
        self.fresh = 1000

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.stop()
        self.store.close()

    # ---- HTTP ----

    def post(self, path: str, body=None, key: str = ATTACKER, method: str = "POST", headers=None,
             fresh: bool = False) -> httpx.Response:
        headers = {"X-API-Key": key, **(headers or {})}
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            headers.setdefault("Content-Type", "application/json")
        elif isinstance(body, bytes):
            headers.setdefault("Content-Type", "application/x-protobuf" if path == FB else "application/json")
        if not fresh:
            return self.http.request(method, path, content=body, headers=headers)
        with httpx.Client(base_url=self.http.base_url, timeout=DONE_S) as client:
            return client.request(method, path, content=body, headers=headers)

    def wait(self, request_id: str, key: str, timeout: float) -> tuple[str, object]:
        """('done' | 'failed' | 'pending', result): JSON dict, protobuf bytes or error message."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.post("/api/v1/retrieve_future", {"request_id": request_id}, key)
            if r.status_code != 200:
                return "failed", f"retrieve_future answered HTTP {r.status_code}: {r.text[:300]}"
            if not r.headers["content-type"].startswith("application/json"):
                return "done", r.content
            body = r.json()
            if body.get("type") != "try_again":
                return ("failed", body["error"]) if "error" in body else ("done", body)
            if time.monotonic() > deadline:
                return "pending", None

    def call(self, path: str, body, key: str = ATTACKER):
        r = self.post(path, body, key)
        assert r.status_code == 200, f"{path}: HTTP {r.status_code} {r.text[:500]}"
        status, result = self.wait(r.json()["request_id"], key, DONE_S)
        assert status == "done", f"{path}: {status} {result}"
        return result

    # ---- the three adapters ----

    def next_seq(self, name: str) -> int:
        self.seq[name] += 1
        return self.seq[name] - 1

    def train(self, name: str, batch: list[list[int]], forward_only: bool = False):
        msg = pb.ForwardBackwardRequest(model_id=self.models[name], seq_id=self.next_seq(name),
                                        loss_fn="cross_entropy", forward_only=forward_only)
        msg.data.extend(datum(tokens, weights=[1.0] * len(tokens)) for tokens in batch)
        return self.call(FB, msg.SerializeToString(), SETUP[name][0])

    def setup(self) -> None:
        sessions = {key: self.call_json("/api/v1/create_session", {"tags": ["hostile"]}, key)["session_id"]
                    for key in (ATTACKER, BYSTANDER)}
        self.session = sessions[ATTACKER]
        for index, (name, (key, seed, _)) in enumerate(SETUP.items()):
            r = self.post("/api/v1/create_model", {"session_id": sessions[key], "model_seq_id": index,
                                                   "base_model": "tiny", "lora_config": {"rank": 4, "seed": seed}}, key)
            self.models[name] = self.wait(r.json()["request_id"], key, DONE_S)[1]["model_id"]
            self.seq[name] = 1
        for name, (key, _, which) in SETUP.items():
            first, second = training_data(which)
            self.train(name, first)
            self.call("/api/v1/optim_step", {"model_id": self.models[name], "seq_id": self.next_seq(name),
                                             "adam_params": {"learning_rate": 1e-2, "weight_decay": 0.01}}, key)
            self.train(name, second)
            for ckpt in ("base", "ttl-target"):
                self.call("/api/v1/save_weights", {"model_id": self.models[name], "seq_id": self.next_seq(name),
                                                   "path": ckpt}, key)
        victim = self.models["victim"]
        self.call("/api/v1/save_weights_for_sampler", {"model_id": victim, "seq_id": self.next_seq("victim"),
                                                       "path": "smp"})
        self.sampler = self.call_json("/api/v1/create_sampling_session", {
            "session_id": self.session, "sampling_session_seq_id": 0,
            "model_path": f"tinker://{victim}/sampler_weights/smp"})["sampling_session_id"]
        self.bystander_sampler = self.call_json("/api/v1/create_sampling_session", {
            "session_id": sessions[BYSTANDER], "sampling_session_seq_id": 0, "base_model": "tiny"},
            BYSTANDER)["sampling_session_id"]
        assert self.probe(DONE_S) is None  # compiles the forward pass
        for sampler, key in ((self.sampler, ATTACKER), (self.bystander_sampler, BYSTANDER)):  # compiles sampling
            assert self.wait(self.sample(sampler, key), key, DONE_S)[0] == "done"
        self.baseline = self.snapshots()
        assert differences(self.baseline["victim"], self.baseline["twin"]) == [], "the twin must equal the victim"

    def call_json(self, path: str, body, key: str = ATTACKER) -> dict:
        r = self.post(path, body, key)
        assert r.status_code == 200, f"{path}: HTTP {r.status_code} {r.text[:500]}"
        return r.json()

    def sample(self, sampler: str, key: str, num_samples: int = 1) -> str:
        self.fresh += 1
        return self.call_json("/api/v1/asample", {
            "sampling_session_id": sampler, "seq_id": self.fresh, "num_samples": num_samples,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 4, "seed": 3}}, key)["request_id"]

    def snapshots(self) -> dict[str, dict[str, np.ndarray]]:
        return {name: adapter_state(self.backend, model_id) for name, model_id in self.models.items()}

    def probe(self, timeout: float = PROBE_S) -> str | None:
        """The victim's next request (a forward pass: it changes nothing); None when it ran in time."""
        seq = self.seq["victim"]
        msg = pb.ForwardBackwardRequest(model_id=self.models["victim"], seq_id=self.next_seq("victim"),
                                        loss_fn="cross_entropy", forward_only=True)
        msg.data.append(datum())
        try:
            r = self.post(FB, msg.SerializeToString(), fresh=True)
        except httpx.HTTPError as e:
            return f"the victim's next request (seq_id {seq}) got no answer: {type(e).__name__}: {e}"
        if r.status_code != 200:
            return f"the victim's next request (seq_id {seq}) was refused: HTTP {r.status_code} {r.text[:300]}"
        request_id = r.json()["request_id"]
        status, result = self.wait(request_id, ATTACKER, timeout)
        if status == "pending":
            self.outstanding.append((request_id, ATTACKER))
            return (f"the victim's next request (seq_id {seq}) did not run within {timeout} s: the refused "
                    "request did not take its seq_id, or the engine is stuck")
        if status != "done":
            return f"the victim's next request (seq_id {seq}) failed: {result}"
        if self.engine.error is not None or not self.engine._thread.is_alive():
            return f"the engine thread stopped: {self.engine.error}"
        return None

    def settle(self) -> None:
        """Before a case: nothing in flight, each adapter as set up (restored if a case changed it)."""
        for request_id, key in self.outstanding:
            self.wait(request_id, key, DONE_S)
        self.outstanding = []
        for name, model_id in self.models.items():  # resynchronise after a case that took a seq_id or not
            expected = self.engine.scheduler.expected_seq(model_id)
            if expected is not None:
                self.seq[name] = expected
        for name, state in self.snapshots().items():
            if differences(self.baseline[name], state):
                self.restore(name)

    def restore(self, name: str) -> None:
        key, _, which = SETUP[name]
        model_id = self.models[name]
        self.call(LOAD, {"model_id": model_id, "seq_id": self.next_seq(name), "optimizer": True,
                         "path": f"tinker://{model_id}/weights/base"}, key)
        self.train(name, training_data(which)[1])
        changed = differences(self.baseline[name], adapter_state(self.backend, model_id))
        assert not changed, f"could not restore {name}: {changed[:5]}"

    def ctx(self) -> Ctx:
        self.fresh += 1
        return Ctx(victim=self.models["victim"], session=self.session, seq=self.seq["victim"],
                   sampler=self.sampler, fresh=self.fresh)


@pytest.fixture(scope="module")
def world(tiny_dirs, tmp_path_factory):
    w = World(tmp_path_factory.mktemp("hostile"), tiny_dirs["dense"])
    try:
        w.setup()
        yield w
    finally:
        w.close()


def answer(world: World, case: Case, ctx: Ctx) -> tuple[str, str]:
    """('refused' | 'failed' | 'done' | 'error', message) of one hostile request."""
    try:  # on a connection of its own: a server that drops it must not break the next request's
        r = world.post(case.route.format(victim=ctx.victim), case.body(ctx), method=case.method, headers=case.headers,
                       fresh=True)
    except httpx.HTTPError as e:
        return "error", f"no HTTP answer: {type(e).__name__}: {e}"
    if 400 <= r.status_code < 500:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        return "refused", str(detail)
    if r.status_code != 200:
        return "error", f"HTTP {r.status_code}: {r.text[:300]}"
    request_id = r.json().get("request_id") if r.headers["content-type"].startswith("application/json") else None
    if request_id is None:
        return "done", r.text[:300]
    status, result = world.wait(request_id, ATTACKER, DONE_S)
    if status == "pending":
        world.outstanding.append((request_id, ATTACKER))
        return "error", f"its future was still pending after {DONE_S} s"
    return status, str(result)[:300]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(world, case):
    world.settle()
    before = world.snapshots()
    ctx = world.ctx()
    problems = []
    outcome, message = answer(world, case, ctx)
    if case.seq:
        world.seq["victim"] += 1  # the refused request took its place in the victim's order
    if outcome in ("refused", "failed"):
        if not any(f in message for f in case.field):
            problems.append(f"{outcome}, but the message does not name {' / '.join(case.field)}: {message!r}")
    elif outcome == "done":
        if not case.may_succeed:
            problems.append(f"accepted and done; expected a 4xx or failed future naming {case.field[0]}")
    else:
        problems.append(message)
    if (trouble := world.probe()) is not None:
        problems.append(trouble)
    for request_id, key in world.outstanding:  # let pending work finish before reading device state
        world.wait(request_id, key, DONE_S)
    world.outstanding = []
    after = world.snapshots()
    for name in before:
        if changed := differences(before[name], after[name]):
            problems.append(f"{name}'s adapter changed: {', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}")
    assert not problems, "; ".join(problems)


def non_finite(state: dict[str, np.ndarray]) -> list[str]:
    return [k for k, v in state.items() if v.dtype.kind == "f" and not np.isfinite(v).all()]


def test_huge_finite_advantages_never_poison_the_adapter(world):
    """Defect 10: advantages of 3e38 are finite in float32, but their gradients come near float32's limit
    and the next optim_step turned the adapter's Adam state non-finite while saying "done". Either the
    forward_backward is refused naming advantages, or it is accepted with finite gradient sums and the
    next optim_step is refused leaving weights and Adam state untouched, or it leaves everything finite."""
    world.settle()
    before = world.snapshots()
    case = Case("advantages-3e38", FB, lambda c: rl(c, "importance_sampling", advantages=ones(3e38)), ("advantages",))
    outcome, message = answer(world, case, world.ctx())
    world.seq["victim"] += 1
    victim = world.models["victim"]
    if outcome in ("refused", "failed"):
        assert "advantages" in message, message
        assert differences(before["victim"], adapter_state(world.backend, victim)) == []
    else:
        assert outcome == "done", message
        assert non_finite(adapter_state(world.backend, victim)) == [], "accepted gradients are not finite"
        r = world.post(OPT, {"model_id": victim, "seq_id": world.next_seq("victim"),
                             "adam_params": {"learning_rate": 1e-3}})
        status, result = world.wait(r.json()["request_id"], ATTACKER, DONE_S) if r.status_code == 200 else (
            "refused", r.text)
        after = adapter_state(world.backend, victim)
        if status == "done":
            assert non_finite(after) == [], f"optim_step said done and left non-finite {non_finite(after)[:4]}"
        else:
            kept = ("grad_sum.", "accumulated")  # the accepted gradients may stay or be dropped
            assert [k for k in differences(before["victim"], after) if not k.startswith(kept)] == [], result
    now = world.snapshots()
    for name in ("twin", "bystander"):
        assert differences(before[name], now[name]) == [], f"{name}'s adapter changed"


HOSTILE_SAMPLES = {
    "top-k-2e40": {"sampling_params": {"max_tokens": 4, "top_k": 2**40}},
    "top-k-2e31": {"sampling_params": {"max_tokens": 4, "top_k": 2**31}},
    "topk-prompt-logprobs-over-vocab": {"prompt_logprobs": True, "topk_prompt_logprobs": VOCAB + 1},
}


@pytest.mark.parametrize("hostile", list(HOSTILE_SAMPLES.values()), ids=list(HOSTILE_SAMPLES))
def test_bystander_sample_survives_hostile_sample_in_same_round(world, hostile):
    """Defect 11: one tenant's bad sampling request must not fail another's in the same backend call."""
    world.settle()
    original = world.backend.sample_submit
    calls: list[int] = []
    entered, gate = threading.Event(), threading.Event()

    def gated(batch):  # hold the engine in a first sampling submit so that the next two queue together
        calls.append(len(batch.request_batch_slices))
        if len(calls) == 1:
            entered.set()
            gate.wait(60)
        return original(batch)

    world.backend.sample_submit = gated
    try:
        first = world.sample(world.bystander_sampler, BYSTANDER)
        assert entered.wait(60)
        ctx = world.ctx()
        body = {"sampling_session_id": ctx.sampler, "seq_id": ctx.fresh, "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}, **hostile}
        r = world.post("/api/v1/asample", body)
        bad = r.json()["request_id"] if r.status_code == 200 else None
        good = world.sample(world.bystander_sampler, BYSTANDER, num_samples=2)
        gate.set()
        results = {rid: world.wait(rid, BYSTANDER if rid != bad else ATTACKER, DONE_S)
                   for rid in (first, good, bad) if rid is not None}
    finally:
        gate.set()
        del world.backend.sample_submit
    if bad is not None:
        assert calls[1] == 2, f"the hostile and the bystander's requests were submitted separately: {calls}"
    status, result = results[good]
    assert status == "done", f"the bystander's sample failed because of another tenant's request: {result}"
    response = pb.SampleResponse()
    response.ParseFromString(result)
    assert len(response.sequences) == 2
    for seq in response.sequences:
        tokens = np.frombuffer(seq.tokens, np.int32)
        assert 1 <= len(tokens) <= 4 and np.all((tokens >= 0) & (tokens < VOCAB))
