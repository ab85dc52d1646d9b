"""Two real `tx.run` processes on 127.0.0.1 (gloo) whose `jax.process_index()` is the reverse of their
`--process-id`, as on a TPU pod (issue 28 item 5): the engine and the control channel's listener must run on
the process launched with `--process-id 0` (the only one that may listen on the coordinator address, see
permuted_run.py), workers join under their launch rank, and the startup log names both ranks."""

import subprocess
import sys
import time
from pathlib import Path

from tests.distributed.test_multihost import ROOT, _env
from tests.ports import free_ports

HELPER = Path(__file__).with_name("permuted_run.py")


def test_smoke_job_runs_when_jax_reverses_the_launch_ranks(tiny_dirs, tmp_path):
    port = free_ports(2)  # jax coordinator, control channel
    common = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--base-model",
              tiny_dirs["dense"], "--fully-sharded-data-parallel-size", "2", "--tensor-parallel-size", "1",
              "--connect-timeout", "30", "--heartbeat-timeout", "10"]
    logs = [tmp_path / "launch0.log", tmp_path / "launch1.log"]
    procs = []
    try:
        for launch, log in enumerate(logs):
            extra = ["--job", "smoke", "--steps", "2"] if launch == 0 else []
            with open(log, "w") as f:  # files, not pipes: an undrained pipe blocks a chatty process
                procs.append(subprocess.Popen(
                    [sys.executable, str(HELPER), "1,0", *common, "--process-id", str(launch), *extra],
                    env=_env(1), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 240
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = [log.read_text() for log in logs]
    report = f"--- launch 0 ---\n{text[0][-4000:]}\n--- launch 1 ---\n{text[1][-4000:]}"
    assert [p.returncode for p in procs] == [0, 0], report
    # The engine (the smoke job's JSON lines) ran where --process-id 0 was launched, a worker on the other.
    assert '"summary": true' in text[0] and '"step": 1' in text[0], report
    assert '"summary"' not in text[1] and "backend '' ready" in text[1], report
    assert "worker process 1 connected" in text[0], report  # the worker joined under its launch rank
    for launch, jax_rank in ((0, 1), (1, 0)):
        assert f"launch rank {launch} is jax.process_index() {jax_rank}" in text[launch], report
