"""What tx did, for operators and for each tenant.

- `GET /metrics`: the Prometheus text format (`prometheus.py`); admin keys only (as X-API-Key, or as
  `Authorization: Bearer <key>`, which Prometheus' scrape config sends).
- `GET /api/v1/sessions/{session_id}/trace`: the session's requests and backend calls as a Chrome JSON trace
  (open it in ui.perfetto.dev), a download; `GET /api/v1/sessions/{session_id}/stats`: its time series and
  latency percentiles as JSON. The session's owner or an admin; any other key gets the 404 of an unknown
  session, like every session route.
- `GET /api/v1/trace` and `GET /api/v1/stats`: the same for the whole server; admin keys only.

Records come from the engine's in-memory rings (`tx/engine/telemetry.py`): the last 100k requests and backend
calls. Requests the rings no longer hold (from before a restart, or dropped by a busy server) come from the
store, which keeps each request's span with its result; backend calls are not stored (lost at a restart).
"""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tx.api import prometheus, timeline
from tx.api.common import ApiError, admin_only, io, owned, tenant
from tx.api.context import ApiContext
from tx.engine.telemetry import CallRecord, QueueSample, RequestRecord, stored_record

MAX_WINDOW_S = 7 * 24 * 3600
SERVER_TRACE_S = 300.0  # the server-wide trace's default window


def check_window(window_s: float | None, step_s: float | None = None) -> None:
    if window_s is not None and not 0 < window_s <= MAX_WINDOW_S:
        raise ApiError(400, f"window_s {window_s} must be in (0, {MAX_WINDOW_S}]")
    if step_s is not None and not 0 < step_s <= (window_s or MAX_WINDOW_S):
        raise ApiError(400, f"step_s {step_s} must be in (0, window_s]")


def trace_response(trace: dict, name: str) -> Response:
    return Response(json.dumps(trace, separators=(",", ":")), media_type="application/json",
                    headers={"Content-Disposition": f'attachment; filename="{name}.trace.json"'})


def router(ctx: ApiContext) -> APIRouter:
    engine, store = ctx.engine, ctx.store
    telemetry = engine.telemetry
    registry = prometheus.registry(engine)
    routes = APIRouter()

    @routes.get("/metrics")
    async def metrics(request: Request):
        admin_only(tenant(request), "GET /metrics (Prometheus)")
        return Response(await io(prometheus.exposition, registry), media_type=prometheus.CONTENT_TYPE)

    async def session_of(session_id: str, request: Request) -> None:
        owned(await io(store.session, session_id), tenant(request), f"session_id {session_id!r}")

    def records(since: float, session_id: str | None = None
                ) -> tuple[list[RequestRecord], list[CallRecord], list[QueueSample]]:
        """The rings' records since `since` plus the stored requests they do not hold."""
        requests, calls, queue = telemetry.snapshot(since, session_id)
        held = {r.request_id for r in requests}
        stored = [stored_record(row) for row in store.request_spans(since, session_id) if row["request_id"] not in held]
        if stored:
            requests = sorted(requests + stored, key=lambda r: r.accepted)
        return requests, calls, queue

    def session_trace(session_id: str, window_s: float | None, totals: bool) -> dict:
        now = time.time()
        requests, calls, _ = records(now - window_s if window_s else 0.0, session_id)
        return timeline.chrome_trace(requests, calls, [], now, session_id, totals)

    @routes.get("/api/v1/sessions/{session_id}/trace")
    async def get_session_trace(session_id: str, request: Request, window_s: float | None = None):
        check_window(window_s)
        await session_of(session_id, request)
        trace = await io(session_trace, session_id, window_s, tenant(request).admin)
        return trace_response(trace, f"tx-{session_id}")

    def window_stats(session_id: str | None, window_s: float, step_s: float | None) -> dict:
        now = time.time()
        requests, calls, _ = records(now - window_s, session_id)
        return timeline.stats(requests, calls, now, window_s, step_s, session_id)

    @routes.get("/api/v1/sessions/{session_id}/stats")
    async def get_session_stats(session_id: str, request: Request, window_s: float = 300.0,
                                step_s: float | None = None):
        check_window(window_s, step_s)
        await session_of(session_id, request)
        return await io(window_stats, session_id, window_s, step_s)

    def server_trace(window_s: float) -> dict:
        now = time.time()
        requests, calls, queue = records(now - window_s)
        return timeline.chrome_trace(requests, calls, queue, now, None, True)

    @routes.get("/api/v1/trace")
    async def get_server_trace(request: Request, window_s: float = SERVER_TRACE_S):
        check_window(window_s)
        admin_only(tenant(request), "GET /api/v1/trace (every tenant's requests)",
                   "GET /api/v1/sessions/{session_id}/trace shows one of its sessions")
        return trace_response(await io(server_trace, window_s), "tx-server")

    @routes.get("/api/v1/stats")
    async def get_server_stats(request: Request, window_s: float = 300.0, step_s: float | None = None):
        check_window(window_s, step_s)
        admin_only(tenant(request), "GET /api/v1/stats (every tenant's requests)",
                   "GET /api/v1/sessions/{session_id}/stats shows one of its sessions")
        return await io(window_stats, None, window_s, step_s)

    return routes
