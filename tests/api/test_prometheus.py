"""GET /metrics (Prometheus text format) and GET /api/v1/metrics are server-wide: admin keys only. After a known
sequence of requests the Prometheus counters, histograms and token counts equal what was sent."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

import tx
from tests.api.telemetry_app import (
    ADMIN,
    KEY,
    LENGTH,
    MAX_TOKENS,
    OTHER,
    PROMPT,
    ROWS,
    SAMPLES,
    app_client,
    headers,
    run_session,
)

pytestmark = pytest.mark.slow

FORWARD_BACKWARD, OPTIM_STEP, SAMPLE = 3, 2, 2


@pytest.fixture(scope="module")
def backend(tiny_dirs):
    return tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(max_lora_adapters=3, max_lora_rank=4, max_seq_len=32))


@pytest.fixture(scope="module")
def served(backend, tmp_path_factory):
    """The app after one session sent FORWARD_BACKWARD passes, OPTIM_STEP steps and SAMPLE sampling requests."""
    with app_client(tmp_path_factory.mktemp("prometheus"), backend) as client:
        run_session(client, FORWARD_BACKWARD, OPTIM_STEP, SAMPLE)
        yield client


def samples(client, key: str = ADMIN) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of every sample GET /metrics answers."""
    r = client.get("/metrics", headers=headers(key))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_need_an_admin_key(served):
    for path in ("/metrics", "/api/v1/metrics"):
        tenant = served.get(path, headers=headers(KEY))
        assert tenant.status_code == 403, (path, tenant.text)
        assert "admin API key" in tenant.json()["detail"]
        assert served.get(path, headers=headers(OTHER)).status_code == 403
        assert served.get(path, headers={"X-API-Key": ""}).status_code == 401
        assert served.get(path, headers=headers("tml-unknown")).status_code == 401
        assert served.get(path, headers=headers(ADMIN)).status_code == 200
    # Prometheus' scrape config sends the key as a bearer token
    assert served.get("/metrics", headers={"X-API-Key": "", "Authorization": f"Bearer {ADMIN}"}).status_code == 200
    assert served.get("/metrics", headers={"X-API-Key": "", "Authorization": f"Bearer {KEY}"}).status_code == 403


def test_admin_reads_the_json_metrics(served):
    body = served.get("/api/v1/metrics", headers=headers(ADMIN)).json()
    assert body["engine"]["submitted_forward_backward"] == FORWARD_BACKWARD
    assert body["backend_calls"].get("optim_step", 0) >= OPTIM_STEP


def test_request_counters_and_latency_histograms_count_what_was_sent(served):
    got = samples(served)
    sent = {"create_model": 1, "forward_backward": FORWARD_BACKWARD, "optim_step": OPTIM_STEP, "sample": SAMPLE}
    for kind, n in sent.items():
        assert got[("tx_requests_total", (("kind", kind), ("status", "done")))] == n, kind
        assert got[("tx_requests_accepted_total", (("kind", kind),))] == n, kind
        assert got[("tx_request_latency_seconds_count", (("kind", kind),))] == n, kind
        assert got[("tx_request_latency_seconds_bucket", (("kind", kind), ("le", "+Inf")))] == n, kind
        assert got[("tx_request_latency_seconds_sum", (("kind", kind),))] > 0, kind
        assert got[("tx_request_queue_seconds_count", (("kind", kind),))] == n, kind
    assert not any(name == "tx_requests_total" and dict(labels)["status"] == "failed" for name, labels in got)
    # buckets are cumulative
    buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in got.items()
                     if name == "tx_request_latency_seconds_bucket" and dict(labels)["kind"] == "forward_backward")
    assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1][1] == FORWARD_BACKWARD


def test_tokens_queue_compiles_and_store_metrics(served):
    got = samples(served)
    assert got[("tx_tokens_total", (("kind", "trained"),))] == FORWARD_BACKWARD * ROWS * LENGTH
    assert got[("tx_tokens_total", (("kind", "sampled"),))] == SAMPLE * SAMPLES * MAX_TOKENS
    assert got[("tx_tokens_total", (("kind", "prompt"),))] == SAMPLE * SAMPLES * len(PROMPT)
    for queue in ("training", "samples", "sampling"):
        assert got[("tx_queue_depth", (("queue", queue),))] == 0, queue  # everything finished
    assert got[("tx_requests_open", ())] == 0
    assert got[("tx_backend_compiles_total", (("base_model", "tiny"), ("program", "forward_backward")))] >= 1
    assert got[("tx_backend_calls_total", (("base_model", "tiny"), ("program", "optim_step")))] == OPTIM_STEP
    assert got[("tx_backend_tokens_real_total", (("base_model", "tiny"), ("program", "forward_backward")))] == \
        FORWARD_BACKWARD * ROWS * LENGTH
    assert got[("tx_store_write_errors_total", ())] == 0 and got[("tx_store_pending_writes", ())] == 0
    assert got[("tx_engine_up", ())] == 1
    assert got[("tx_info", (("base_model", "tiny"), ("default", "true"), ("version", tx.__version__)))] == 1
    assert ("tx_compile_cache_hits_total", ()) in got
    kv = {name: v for (name, labels), v in got.items() if name.startswith("tx_kv_cache_")}
    assert 0 <= kv["tx_kv_cache_pages_in_use"] <= kv["tx_kv_cache_peak_pages"] <= kv["tx_kv_cache_pages"], kv
    assert kv["tx_kv_cache_peak_pages"] >= 1 and kv["tx_kv_cache_pages_uncached_total"] >= 0, kv


def test_two_apps_in_one_process_have_their_own_registries(served, backend, tmp_path):
    """A second app (its own engine) starts at zero: the registries do not share collectors or clash."""
    with app_client(tmp_path, backend) as other:
        got = samples(other)
        assert not any(name == "tx_requests_total" for name, _ in got)
        assert got[("tx_requests_open", ())] == 0
    assert samples(served)[("tx_requests_total", (("kind", "optim_step"), ("status", "done")))] == OPTIM_STEP
