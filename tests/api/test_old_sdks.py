"""Older `tinker` SDKs run the basic flow against a real `python -m tx.run` subprocess.

0.19.0 is the oldest SDK tx serves: it sends forward_backward as protobuf when the client config says
`proto_write_fwdbwd`, and `forward` as JSON to /api/v1/forward (tx/api/wire_json.py). 0.18 and older
also need JSON forward_backward *results*, which tx does not produce. 0.28.1 is a middle version (always
protobuf). .ci/run installs each into .ci/sdk/tinker-<version> (`pip install --target ... --no-deps`:
their dependencies are those of the installed 0.38) and sets TX_REQUIRE_ALL=1, so that in CI a
missing directory fails instead of skipping (tests/require.py).

Reference: the same flow with the installed SDK 0.38 on the same server (same seed, so the same initial
adapter): losses, log-probs and greedy samples must agree to 1e-5.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker

from tests.api.server_proc import ADMIN_KEY, API_KEY, Server
from tests.require import skip_or_fail

pytestmark = pytest.mark.slow  # a server start and three SDK flows: ~20 s on a quiet 2-core machine

ROOT = Path(__file__).parents[2]
SDK_ROOT = ROOT / ".ci" / "sdk"
OLD_SDKS = ("0.19.0", "0.28.1")  # keep in step with .ci/run
FLOW = Path(__file__).with_name("old_sdk_flow.py")


def sdk_dir(version: str) -> Path:
    path = SDK_ROOT / f"tinker-{version}"
    if not (path / "tinker" / "__init__.py").exists():
        reason = (f"tinker {version} is not installed in {path}; .ci/run installs it "
                  f"(pip install --target {path} --no-deps tinker=={version})")
        skip_or_fail(reason)
    return path


def run_flow(url: str, version: str, sdk_path: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(sdk_path)] if sdk_path else []))
    proc = subprocess.run([sys.executable, str(FLOW), url, API_KEY, version], env=env, capture_output=True,
                          text=True, timeout=240, cwd=ROOT, check=False)
    assert proc.returncode == 0, f"tinker {version} flow failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=OLD_SDKS)
def old_sdk(request) -> tuple[str, Path]:
    """(version, directory); module-scoped and listed first so that a missing SDK skips before a server starts."""
    return request.param, sdk_dir(request.param)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("old_sdks"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(server) -> dict:
    return run_flow(server.url, tinker.__version__, None)


def engine_counts(server) -> dict:
    r = server.get("/api/v1/metrics", key=ADMIN_KEY)
    assert r.status_code == 200, r.text
    return r.json()["engine"]


def test_old_sdk_basic_flow(old_sdk, server, reference):
    version, path = old_sdk
    before = engine_counts(server)
    out = run_flow(server.url, version, path)
    after = engine_counts(server)
    assert out["version"] == version
    for key, n in (("submitted_create_model", 1), ("submitted_forward_backward", 4), ("submitted_optim_step", 4),
                   ("submitted_forward", 1), ("submitted_save_weights_for_sampler", 2), ("submitted_sample", 2)):
        assert after.get(key, 0) - before.get(key, 0) == n, (key, before, after)

    losses = out["losses"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.8 * losses[0], losses
    np.testing.assert_allclose(losses, reference["losses"], rtol=1e-5)
    np.testing.assert_allclose(out["first_logprobs"], reference["first_logprobs"], atol=1e-5)
    np.testing.assert_allclose(out["forward_logprobs"], reference["forward_logprobs"], atol=1e-5)
    np.testing.assert_allclose(out["forward_loss"], -np.sum(out["forward_logprobs"]), rtol=1e-5)
    # the loss of the first step is that of its returned log-probs (weights 1)
    np.testing.assert_allclose(losses[0], -np.sum(out["first_logprobs"]), rtol=1e-5)

    assert out["sampler_path"] == f"tinker://{out['model_id']}/sampler_weights/final"
    named, snap, ref = out["named"], out["snapshot"], reference["named"]
    assert len(named) == 2 and len(snap) == 1
    for seq in named + snap:
        assert seq["tokens"] == ref[0]["tokens"] and len(seq["tokens"]) == 5, (seq, ref)
        np.testing.assert_allclose(seq["logprobs"], ref[0]["logprobs"], atol=1e-5)
    assert all(s["stop_reason"] == "length" for s in named)


def test_json_pass_bodies_refused_by_field(server, reference):
    """Bad JSON forward/forward_backward bodies (the older SDKs' encoding) answer 400 naming the field."""
    model_id = reference["model_id"]
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
             "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64"}}}

    def post(route: str, key: str, data: list, **extra) -> httpx.Response:
        body = {key: {"data": data, "loss_fn": "cross_entropy", **extra}, "model_id": model_id, "seq_id": 10**6}
        return server.post(route, json=body)

    cases = [
        (dict(datum, loss_fn_inputs={"target_tokens": {"data": [2.5, 3, 4], "dtype": "int64"}}),
         "loss_fn_inputs['target_tokens']: dtype int64 needs integer values"),
        (dict(datum, loss_fn_inputs={"target_tokens": {"data": [2, 3, 4], "dtype": "bfloat16"}}), "dtype"),
        (dict(datum, model_input={"chunks": [{"type": "image", "data": "x"}]}), "image chunks are not supported"),
        (dict(datum, model_input={"chunks": [{"type": "encoded_text", "tokens": [2**40]}]}), "does not fit int32"),
        (dict(datum, loss_fn_inputs={"target_tokens": {"data": [1], "dtype": "int64",
                                                       "sparse_crow_indices": [0, 1]}}),
         "sparse_crow_indices and sparse_col_indices go together"),
    ]
    for route, key in (("/api/v1/forward", "forward_input"), ("/api/v1/forward_backward", "forward_backward_input")):
        for bad, message in cases:
            r = post(route, key, [bad])
            assert r.status_code == 400 and message in r.json()["detail"], (route, bad, r.text)
        r = server.post(route, json={key: {"data": [datum]}, "model_id": model_id, "seq_id": 1})
        assert r.status_code == 400 and "loss_fn" in r.json()["detail"], r.text
