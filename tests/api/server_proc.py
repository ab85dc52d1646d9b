"""Start `python -m tx.run` as a real subprocess on a free port and wait until it answers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.helpers import cpu_xla_flags
from tests.ports import free_ports

API_KEY = "tml-tx-test-key"
ADMIN_KEY = "tml-tx-test-admin-key"  # reads the server-wide numbers (/api/v1/metrics, /metrics)
# SDK clients by server URL: closed before their server stops, so that no heartbeat or telemetry thread
# keeps retrying a dead server (and holding up the test process at exit)
CLIENTS: dict[str, list] = {}


def free_port() -> int:
    return free_ports(1)


class Server:
    def __init__(self, data_dir: Path, *args: str, cwd: Path | None = None, base_model: str | None = None,
                 devices: int = 1, startup_timeout: float = 240):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = data_dir / f"server-{self.port}.log"
        data_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "XLA_FLAGS": cpu_xla_flags(devices),
               "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
        cmd = [sys.executable, "-m", "tx.run", "--port", str(self.port), "--data-dir", str(data_dir),
               "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY,
               "--max-lora-adapters", "24", "--max-lora-rank", "8", "--max-seq-len", "128",
               *(["--base-model", base_model] if base_model else []), *args]
        self._log = open(self.log_path, "w")  # a file, not a pipe: a full pipe would stall the server
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not come up in {startup_timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def get(self, path: str, key: str = API_KEY, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers={"X-API-Key": key}, timeout=60, **kw)

    def post(self, path: str, key: str = API_KEY, **kw) -> httpx.Response:
        return httpx.post(self.url + path, headers={"X-API-Key": key, **kw.pop("headers", {})}, timeout=60, **kw)

    def stop(self) -> int:
        for client in CLIENTS.pop(self.url, []):
            try:
                client.close("success").result(timeout=30)
            except Exception:  # noqa: BLE001 - a client of a failed test may be unusable
                pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
