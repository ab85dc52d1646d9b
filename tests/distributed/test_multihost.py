"""Two real processes on 127.0.0.1 (4 CPU devices each, gloo): errors on workers; dead and stopped workers;
CLI behaviour. The helpers here start such pairs (and the one-process peer) for the other multi-host tests;
parity with one process is in test_multihost_parity.py (its own file, so xdist runs it beside these)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import cpu_xla_flags
from tests.ports import free_ports

DRIVER = Path(__file__).with_name("driver.py")
ROOT = Path(__file__).parents[2]


def _ports() -> int:
    """A port p with p and p + 1 free (jax coordinator, control channel)."""
    return free_ports(2)


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = cpu_xla_flags(devices)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT)
    return env


def run_pair(scenario: str, model_dir: str, tmp_path: Path, timeout: float = 240, worker_env: dict | None = None,
             worker_cwd: Path | None = None):
    port = _ports()
    out = tmp_path / f"{scenario}-multi.json"
    coordinator = f"127.0.0.1:{port}"
    # Output goes to files: an undrained pipe would fill up with log lines and block a process.
    log0, log1 = tmp_path / f"{scenario}-p0.log", tmp_path / f"{scenario}-p1.log"
    with open(log0, "w") as f0, open(log1, "w") as f1:
        p0 = subprocess.Popen([sys.executable, str(DRIVER), scenario, model_dir, str(out), coordinator, "2"],
                              env=_env(4), cwd=ROOT, stdout=f0, stderr=subprocess.STDOUT)
        p1 = subprocess.Popen([sys.executable, "-m", "tx.run", "--coordinator-address", coordinator, "--num-processes",
                               "2", "--process-id", "1", "--base-model", model_dir, "--heartbeat-timeout", "3"],
                              env={**_env(4), **(worker_env or {})}, cwd=worker_cwd or ROOT, stdout=f1,
                              stderr=subprocess.STDOUT)
        try:
            p0.wait(timeout=timeout)
        finally:
            if p0.poll() is None:
                p0.kill()
            try:
                p1.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p1.kill()
                p1.wait()
    assert p0.returncode == 0, log0.read_text()[-4000:] + "\n--- worker ---\n" + log1.read_text()[-4000:]
    return json.loads(out.read_text()), p1.returncode, log1.read_text()


def run_single(scenario: str, model_dir: str, tmp_path: Path):
    out = tmp_path / f"{scenario}-single.json"
    proc = subprocess.run([sys.executable, str(DRIVER), scenario, model_dir, str(out)], env=_env(8), cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _close(a, b, path=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and a and isinstance(a[0], (list, dict)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, list) and a and isinstance(a[0], int):
        assert a == b, path  # token ids: exactly equal
    else:
        np.testing.assert_allclose(np.asarray(a, float), np.asarray(b, float), atol=2e-5, rtol=1e-5, err_msg=path)


def test_worker_errors_are_reported_and_the_next_call_works(tiny_dirs, tmp_path):
    """Errors before anyone runs a call, and files missing on the worker only (defect 4's clean path),
    fail that call on every host and leave state alone; peers without the secret are refused (defect 2)."""
    elsewhere = tmp_path / "worker-cwd"  # the worker resolves the relative checkpoint paths here: missing
    elsewhere.mkdir()
    result, worker_rc, worker_log = run_pair("faults", tiny_dirs["dense"], tmp_path, worker_cwd=elsewhere)
    errors = result["errors"]
    assert "process 1: RuntimeError: injected in prepare" in errors[0]
    for error, path in zip(errors[1:3], ("ckpt-here", "sampler-here.tar.gz")):
        assert "process 1: hosts disagree before" in error and f"{path}: process 0 ok, here CheckpointNotFound" in error
    assert "local: model_id 'a' already exists" in errors[3]
    assert result["after_prepare"] == result["after_missing"] == result["final"]  # b was not overwritten
    assert result["refused"] == result["refused_later"] == {"garbage": True, "no-mac": True, "wrong-secret": True}
    assert result["bound"][0] == "127.0.0.1"  # a loopback coordinator address keeps the channel on loopback
    assert worker_rc == 0


def test_one_sided_failure_inside_a_call_is_fatal_within_the_bound(tiny_dirs, tmp_path):
    """Defect 4: the worker fails inside forward while process 0 waits in the call's collective."""
    result, worker_rc, worker_log = run_pair("one_sided", tiny_dirs["dense"], tmp_path,
                                             worker_env={"TX_DEBUG_FAIL_CALL": "forward"}, timeout=150)
    failure = result["failure"]
    assert "call forward failed on some hosts while process 0 was still running it" in failure["error"]
    assert "process 1: RuntimeError: injected failure of forward on process 1" in failure["error"]
    assert failure["seconds"] < 3.0 + 5.0  # heartbeat_timeout=3s: a report is seen at once, plus slack
    assert failure["error"] in result["later"]["error"] and result["later"]["seconds"] < 1.0  # no further calls
    assert worker_rc == 1 and "process 0 stopped the run" in worker_log


def test_stopped_worker_is_reported_within_the_bound(tiny_dirs, tmp_path):
    result, _, _ = run_pair("stop", tiny_dirs["dense"], tmp_path)
    failure = result["failure"]
    assert "worker process 1 is unresponsive" in failure["error"]
    assert failure["seconds"] < 3.0 + 5.0  # heartbeat_timeout=3s, plus scheduling slack
    assert "worker process 1" in result["later"]["error"] and result["later"]["seconds"] < 1.0


def test_killed_worker_is_reported_without_hanging(tiny_dirs, tmp_path):
    result, worker_rc, _ = run_pair("kill", tiny_dirs["dense"], tmp_path)
    assert "worker process 1 died" in result["failure"]["error"]
    assert result["failure"]["seconds"] < 60
    assert worker_rc != 0


def test_cli_help_and_validation(monkeypatch, capsys):
    """In-process: every case below exits while parsing and validating, before anything starts."""
    import logging

    from tx import run

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # main() reconfigures logging: restored after
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.delenv("TX_CONTROL_SECRET", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--coordinator-address", "--process-id", "--heartbeat-timeout", "--tensor-parallel-size",
                 "--backend-config", "--auto-distributed", "--control-secret-file", "--control-secret", "--control-bind"):
        assert flag in help_text
    for args, message in [
        (["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "2"], "outside [0, --num-processes=2)"),
        (["--num-processes", "2"], "go together"),
        (["--coordinator-address", "nohost", "--num-processes", "1", "--process-id", "0"], "must be host:port"),
        (["--backend-config", "{bad"], "not valid JSON"),
        (["--max-lora-rank", "0"], "max_lora_rank"),
        (["--backend-config", '{"unknown_field": 1}'], "unknown_field"),
        # defect 2: a control channel reachable from other machines needs a shared secret
        (["--coordinator-address", "10.255.0.1:8476", "--num-processes", "2", "--process-id", "1"],
         "non-loopback host '10.255.0.1' needs a shared secret"),
        (["--coordinator-address", "10.255.0.1:8476", "--num-processes", "2", "--process-id", "1",
          "--control-secret-file", "/nonexistent/secret"], "--control-secret-file '/nonexistent/secret' cannot be read"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            run.main(args)
        stderr = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in stderr, (args, stderr[-500:])


def test_sigterm_on_process_zero_shuts_every_host_down(tiny_dirs, tmp_path):
    import signal
    import time

    port = _ports()
    common = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--base-model", tiny_dirs["dense"],
              "--fully-sharded-data-parallel-size", "4", "--tensor-parallel-size", "2"]
    log0, log1 = tmp_path / "p0.log", tmp_path / "p1.log"
    with open(log0, "w") as f0, open(log1, "w") as f1:
        p0 = subprocess.Popen([sys.executable, "-m", "tx.run", *common, "--process-id", "0", "--job", "smoke", "--steps", "100000"],
                              env=_env(4), cwd=ROOT, stdout=f0, stderr=subprocess.STDOUT)
        p1 = subprocess.Popen([sys.executable, "-m", "tx.run", *common, "--process-id", "1"],
                              env=_env(4), cwd=ROOT, stdout=f1, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while '"step": 1' not in log0.read_text():  # training runs on both hosts
                assert p0.poll() is None and time.monotonic() < deadline, log0.read_text()[-3000:]
                time.sleep(0.2)
            p0.send_signal(signal.SIGTERM)
            start = time.monotonic()
            rc0 = p0.wait(timeout=60)
            rc1 = p1.wait(timeout=60)
        finally:
            for p in (p0, p1):
                if p.poll() is None:
                    p.kill()
    assert rc0 == 143 and rc1 == 0, (rc0, rc1, log0.read_text()[-3000:], log1.read_text()[-2000:])
    assert time.monotonic() - start < 60


AGREE = """
import sys, jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from tx.models.sharding import min_over_processes
print("AGREED", min_over_processes(int(sys.argv[3])))
"""


def test_processes_with_different_values_agree_on_the_smallest():
    """The default KV pool is sized by each host's memory; `min_over_processes` makes every host use the
    smallest: process 0 offers 1005 and process 1 offers 1004, and both must get 1004."""
    coordinator = f"127.0.0.1:{_ports()}"
    procs = [subprocess.Popen([sys.executable, "-c", AGREE, coordinator, str(i), str(1005 - i)], env=_env(1),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    agreed = [int(line.split()[1]) for out in outs for line in out.splitlines() if line.startswith("AGREED")]
    assert agreed == [1004, 1004], outs
