"""tpu_scripts/tpu.py: the gcloud commands it generates and its argument checks."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "tpu_scripts" / "tpu.py"


def dry(*args: str) -> list[list[str]]:
    out = subprocess.run([sys.executable, str(SCRIPT), *args, "--dry-run"] if "--" not in args else
                         [sys.executable, str(SCRIPT), *args[: args.index("--")], "--dry-run", *args[args.index("--"):]],
                         capture_output=True, text=True, check=True).stdout
    return [shlex.split(line) for line in out.strip().splitlines()]


@pytest.mark.parametrize("tpu_type,version", [("v6e-16", "v2-alpha-tpuv6e"), ("v5p-16", "v2-alpha-tpuv5"),
                                              ("v5litepod-8", "v2-alpha-tpuv5-lite")])
def test_create(tpu_type, version):
    [cmd] = dry("create", "--name", "pod", "--zone", "us-east5-b", "--type", tpu_type, "--project", "p1")
    assert cmd[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "pod"]
    assert f"--accelerator-type={tpu_type}" in cmd and f"--version={version}" in cmd
    assert cmd[cmd.index("--project") + 1] == "p1" and cmd[cmd.index("--zone") + 1] == "us-east5-b"


def test_setup_launch_logs_stop():
    [setup] = dry("setup", "--name", "pod", "--zone", "z", "--repo", "https://x/tx.git", "--ref", "v1")
    assert "--worker=all" in setup and "pip install -e '.[tpu]'" in setup[-1] and "git checkout v1" in setup[-1]
    [launch] = dry("launch", "--name", "pod", "--zone", "z", "--", "--base-model", "Qwen/Qwen3-8B", "--tensor-parallel-size", "4")
    assert "--worker=all" in launch
    assert "python -m tx.run --auto-distributed --base-model Qwen/Qwen3-8B --tensor-parallel-size 4" in launch[-1]
    assert "~/tx-logs/worker.log" in launch[-1]
    [logs] = dry("logs", "--name", "pod", "--zone", "z", "--worker", "2")
    assert "--worker=2" in logs and "tail -n 100" in logs[-1]
    [stop] = dry("stop", "--name", "pod", "--zone", "z")
    assert "pkill -TERM" in stop[-1]


def test_bad_type_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "create", "--name", "p", "--zone", "z", "--type", "v9x-8",
                           "--dry-run"], capture_output=True, text=True)
    assert proc.returncode != 0 and "unknown accelerator type 'v9x-8'" in proc.stderr
