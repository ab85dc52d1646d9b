"""How sampling in flight shares the engine with training (tx/engine/sampling.py), with a stand-in backend
whose calls take known times: a long sampling job does not keep forward_backward out, a stream of
forward_backward does not stop sampling, device time splits by `sampling_share`, a request that arrives
while a job runs joins it, and a failing step fails every request in flight and nothing else."""

from __future__ import annotations

import time

import pytest

from tests.engine.test_engine import FakeBackend, wait_for
from tx import types
from tx.engine.engine import Engine, EngineConfig
from tx.engine.ops import CreateRequest, Datum, PassRequest, SampleRequest
from tx.engine.schema import sessions
from tx.engine.store import Store

STEP_S, PASS_S = 0.02, 0.2


class TimedBackend(FakeBackend):
    """sample_step takes STEP_S and advances every request by one token; forward_backward takes PASS_S."""

    def __init__(self):
        super().__init__()
        self.running: dict[str, int] = {}  # request id -> steps left
        self.log: list[tuple[str, float, float]] = []  # (call, start, end)
        self.fail_next_step = False

    def _timed(self, name: str, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.log.append((name, start, time.perf_counter()))

    def forward_backward(self, batch):
        self._timed("forward_backward", PASS_S)
        return {s[0]: types.ForwardBackwardOutput(loss_fn_outputs=[], metrics={}) for s in batch.request_batch_slices}

    def sample_submit(self, batch):
        for request_id, _, start, end, *_ in batch.request_batch_slices:
            self.running[request_id] = batch.all_sampling_params[start].max_tokens
        return {}

    def sample_step(self):
        if self.fail_next_step:
            self.fail_next_step = False
            self.running.clear()
            raise RuntimeError("device lost")
        self._timed("sample_step", STEP_S)
        for request_id in self.running:
            self.running[request_id] -= 1
        done = [r for r, left in self.running.items() if left <= 0]
        for r in done:
            del self.running[r]
        return {r: types.SampleOutput(sequences=[]) for r in done}


@pytest.fixture
def engine(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'tx.sqlite'}")
    backend = TimedBackend()
    eng = Engine(backend, store, EngineConfig(checkpoint_root=str(tmp_path / "ck"), sampling_share=0.5), "base",
                 lambda out: ("application/octet-stream", b"pass"), lambda out: ("application/octet-stream", b"sample"))
    eng.start()
    yield eng
    eng.stop()
    store.close()


def done(eng: Engine, request_id: str, timeout: float = 30.0) -> float:
    assert wait_for(lambda: eng.store.future(request_id).status != "pending", timeout), request_id
    assert eng.store.future(request_id).status == "done", eng.store.future(request_id)
    return time.perf_counter()


def sample(eng: Engine, name: str, tokens: int) -> str:
    request = SampleRequest([1, 2, 3], types.SamplingParams(max_tokens=tokens), 1, False, 0, "")
    return eng.submit("sample", request, f"sample:{name}", size=1)


def test_training_and_sampling_alternate_by_share(engine):
    backend = engine.backend
    model = "m:train:0"
    with engine.store.engine.begin() as conn:
        conn.execute(sessions.insert().values(session_id="s", created_at=time.time(), last_heartbeat=time.time(),
                                              status="active", tags=[], user_metadata={}))
    engine.store.add_model(model, "s", "base", {}, {})
    done(engine, engine.submit("create_model", CreateRequest(None), "create", model, 0))
    long = sample(engine, "long", 300)  # 300 steps = 6 s alone
    time.sleep(0.2)
    passes = []
    for seq in range(1, 6):  # a tenant sending forward_backward back to back
        request = PassRequest([Datum([1, 2], [2, 3], [1.0, 1.0], [], [])], "cross_entropy", None)
        passes.append(done(engine, engine.submit("forward_backward", request, f"fb{seq}", model, seq)))
    # each pass waited at most about one pass's worth of sampling (share 0.5), not for the 6 s job
    waits = [b - a for a, b in zip(passes, passes[1:])]
    assert max(waits) < 2 * PASS_S + 0.6, waits  # + scheduling slack on a loaded 2-core machine
    assert backend.running.get(long, 0) > 0  # the job is still running
    # between consecutive passes sampling ran for about as long as a pass: at least one step, a bounded number
    calls = [name for name, *_ in backend.log]
    fbs = [i for i, name in enumerate(calls) if name == "forward_backward"]
    between = [fbs[k + 1] - fbs[k] - 1 for k in range(len(fbs) - 1)]
    assert all(1 <= n <= 2 * PASS_S / STEP_S for n in between), between
    done(engine, long)


def test_a_request_arriving_mid_job_joins_it(engine):
    long = sample(engine, "long", 200)
    time.sleep(0.5)
    start = time.perf_counter()
    short = sample(engine, "short", 5)
    short_end = done(engine, short)
    assert short_end - start < 0.5  # 5 steps of 0.02 s, not the long job's 4 s
    assert engine.store.future(long).status == "pending"
    done(engine, long)


def test_a_failing_step_fails_the_requests_in_flight_only(engine):
    first, second = sample(engine, "a", 50), sample(engine, "b", 60)
    time.sleep(0.3)
    engine.backend.fail_next_step = True
    for request_id in (first, second):
        assert wait_for(lambda r=request_id: engine.store.future(r).status != "pending", 10.0)
        assert engine.store.future(request_id).status == "failed"
    assert engine._in_flight == {} and engine._in_flight_sequences == 0
    done(engine, sample(engine, "after", 3))  # the engine goes on
