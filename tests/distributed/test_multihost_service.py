"""Defect 4 through the service: `python -m tx.run` serving on process 0 while the worker fails inside a
forward_backward. Process 0 reports it within the heartbeat bound and exits non-zero, the worker exits,
and after a restart the client's in-flight future ends failed (not pending forever)."""

import subprocess
import sys
import time

import numpy as np
import pytest

from tests.api import sdk_flows
from tests.api.server_proc import Server
from tests.distributed import test_multihost as multihost

pytestmark = pytest.mark.slow
HEARTBEAT_TIMEOUT = 3.0


def result_of(server: Server, request_id: str) -> dict:
    while True:
        r = server.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200, r.text
        body = r.json()
        if body.get("type") != "try_again":
            return body


def test_one_sided_failure_stops_the_service_and_the_future_fails_after_restart(tmp_path):
    port = multihost._ports()
    procs = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
             "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)]
    data = tmp_path / "data"
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen([sys.executable, "-m", "tx.run", *procs, "--process-id", "1"],
                                  env={**multihost._env(4), "TX_DEBUG_FAIL_CALL": "forward_backward"},
                                  cwd=multihost.ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            srv = Server(data, *procs, "--process-id", "0", "--fully-sharded-data-parallel-size", "4",
                         "--tensor-parallel-size", "2", devices=4)
            try:
                session = srv.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}}).json()["session_id"]
                r = srv.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                           "base_model": "tiny", "lora_config": {"rank": 8}})
                model_id = result_of(srv, r.json()["request_id"])["model_id"]
                tokens = np.random.default_rng(0).integers(0, 500, (4, 17))
                r = srv.post("/api/v1/forward_backward", content=sdk_flows.fb_body(model_id, 1, tokens),
                             headers={"Content-Type": "application/x-protobuf"})
                request_id = r.json()["request_id"]
                start = time.monotonic()
                rc = srv.proc.wait(timeout=120)
                stopped_after = time.monotonic() - start
            finally:
                srv.stop()
            assert worker.wait(timeout=60) == 1  # told by process 0 that the run is over
        finally:
            if worker.poll() is None:
                worker.kill()
    log0 = srv.log()
    assert rc == 3, log0[-3000:]
    assert "call forward_backward failed on some hosts while process 0 was still running it" in log0
    assert "injected failure of forward_backward on process 1" in log0
    # The worker reports at once (the bound is the heartbeat timeout); slack for a loaded machine.
    assert stopped_after < HEARTBEAT_TIMEOUT + 15, stopped_after
    assert "process 0 stopped the run" in (tmp_path / "worker.log").read_text()

    again = Server(data)  # one process, same data: a restart
    try:
        failed = result_of(again, request_id)
        assert failed["category"] == "server" and "restarted" in failed["error"], failed
    finally:
        again.stop()
