"""Routes about the server itself: the health check, the SDK's client configuration and telemetry, the
models served, and the server-wide metrics and device memory (admin keys only: tenants see their own sessions'
numbers at /api/v1/sessions/{session_id}/stats and /trace, `telemetry_routes`)."""

from __future__ import annotations

import jax
from fastapi import APIRouter, Request

from tx.api.common import admin_only, io, tenant
from tx.api.context import ApiContext
from tx.models.registry import family_names
from tx.runtime import compile_cache_stats

INSTEAD = "a tenant sees its own sessions' numbers at /api/v1/sessions/{session_id}/stats and /trace"

MEMORY_STATS = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")


def device_memory() -> list[dict]:
    """This process's devices and their memory (bytes; None where the platform reports none, e.g. CPU)."""
    out = []
    for d in jax.local_devices():
        try:
            stats = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 - a platform without memory stats
            stats = {}
        out.append({"device": str(d), "platform": d.platform, **{k: stats.get(k) for k in MEMORY_STATS}})
    return out


def router(ctx: ApiContext) -> APIRouter:
    engine, config = ctx.engine, ctx.config
    routes = APIRouter()

    @routes.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @routes.post("/api/v1/client/config")
    async def client_config(request: Request):
        await ctx.read_body(request)
        # the SDK splits a forward_backward into requests of at most these sizes; at 4 bytes or more per
        # token in its estimate, a request then holds at most max_request_tokens tokens
        limits = {"fwdbwd_max_chunk_len": min(1024, engine.config.max_pass_datums),
                  "fwdbwd_max_chunk_bytes_count": min(5_000_000, 4 * engine.config.max_request_tokens)}
        # proto_write_fwdbwd / fwd_via_fwdbwd: SDKs 0.22-0.24 send protobuf forward(_backward) bodies only when told
        return {**limits, "pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": config.compress_fwdbwd,
                "proto_write_fwdbwd": True, "fwd_via_fwdbwd": True,
                "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                "sample_join_sampling_session": False}

    @routes.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request):
        await ctx.read_body(request)
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @routes.post("/api/v1/telemetry")
    async def telemetry(request: Request):
        await ctx.read_body(request)  # accepted and dropped
        return {"status": "accepted"}

    @routes.get("/api/v1/get_server_capabilities")
    async def capabilities():
        # arch / family / renderer_name: extra fields the SDK ignores, for clients that pick a renderer
        return {"supported_models": [{"model_name": m.model_name, "max_context_length": m.max_context_length,
                                      "trainable": True, "sampleable": True, "training_mode": m.training_mode,
                                      "arch": m.arch, **family_names(m.arch)}
                                     for m in ctx.models.all]}

    @routes.get("/api/v1/metrics")
    async def metrics(request: Request):
        admin_only(tenant(request), "GET /api/v1/metrics (server-wide counters)", INSTEAD)
        backend = engine.backend.metrics
        return {"engine": dict(engine.metrics), "backend_compiles": backend.compiles, "backend_calls": backend.calls,
                "backend_tokens_real": backend.tokens_real, "backend_tokens_padded": backend.tokens_padded,
                "backend_sampling": backend.sampling,
                "backend_calls_by_base_model": {name: b.metrics.calls for name, b in engine.backends.items()},
                "compile_cache": compile_cache_stats(), "device_memory": await io(device_memory)}

    return routes
