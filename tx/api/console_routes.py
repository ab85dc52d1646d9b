"""The web console (`GET /console`: one page, its script and stylesheet, shipped in `tx/api/static/`) and the small
JSON routes it reads beside the Tinker API's own.

The console's files hold no data and are served without a key (a browser cannot send X-API-Key to open a page);
the page keeps the key the user signs in with in sessionStorage and sends it as X-API-Key on every API call, so
every view shows what that key may read: its own sessions and runs, or every tenant's for an admin key.

- `GET /api/v1/console/whoami`: whether the key is an admin's, and its tenant id (a prefix of the SHA-256).
- `GET /api/v1/console/sessions`: the key's sessions (an admin: everyone's), newest first, with their status,
  times and the ids of their training runs and sampling sessions.
- `GET /api/v1/training_runs/{run_id}/loss_history`: the run's steps (loss:sum, tokens, metrics of the
  forward_backward calls before each optim_step), from the engine's in-memory `LossHistory`, else (after a
  restart) from the store's `train_steps`;
  the run's owner or an admin, else the 404 of an unknown run.
"""

from __future__ import annotations

import math
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tx.api.common import ApiError, io, iso, owned, page, tenant
from tx.api.context import ApiContext
from tx.engine.telemetry import step_of_row

PREFIX = "/console"
FILES = {"index.html": "text/html; charset=utf-8", "console.js": "text/javascript; charset=utf-8",
         "console.css": "text/css; charset=utf-8"}
# the page loads nothing from elsewhere and runs no inline script
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data: blob:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def is_console_path(path: str) -> bool:
    """The console's static files: served without an API key."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def static_file(name: str) -> bytes:
    return (resources.files("tx.api") / "static" / name).read_bytes()


def number(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def router(ctx: ApiContext) -> APIRouter:
    engine, store = ctx.engine, ctx.store
    routes = APIRouter()

    @routes.get(PREFIX)
    @routes.get(PREFIX + "/")
    async def console_page():
        return await console_file("index.html")

    @routes.get(PREFIX + "/{name}")
    async def console_file(name: str):
        if name not in FILES:
            raise ApiError(404, f"console file {name!r} not found")
        return Response(await io(static_file, name), media_type=FILES[name],
                        headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                                 "Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"})

    @routes.get("/api/v1/console/whoami")
    async def whoami(request: Request):
        who = tenant(request)
        return {"admin": who.admin, "tenant": who.id[:12]}

    def session_json(session_id: str, admin: bool) -> dict | None:
        s = store.session(session_id)
        if s is None:
            return None
        models, _ = store.list_models(1000, 0, session_id)
        out = {"session_id": session_id, "status": s["status"], "created_at": iso(s["created_at"]),
               "last_heartbeat": iso(s["last_heartbeat"]), "display_name": s["display_name"],
               "sdk_version": s["sdk_version"], "training_run_ids": [m["model_id"] for m in models],
               "sampler_ids": store.sampling_session_ids(session_id)}
        if admin:
            out["tenant"] = (s["owner"] or "")[:12]
        return out

    @routes.get("/api/v1/console/sessions")
    async def console_sessions(request: Request, limit: int = 50, offset: int = 0):
        who = tenant(request)
        ids = await io(store.list_sessions, *page(limit, offset), who.filter)
        rows = [await io(session_json, i, who.admin) for i in ids]
        return {"sessions": [r for r in rows if r is not None]}

    @routes.get("/api/v1/training_runs/{run_id}/loss_history")
    async def loss_history(run_id: str, request: Request):
        owned(await io(store.model, run_id), tenant(request), f"training run {run_id!r}")
        steps, pending = engine.loss_history.of(run_id)
        if not steps:  # trained before a restart (or dropped from memory): the stored steps
            steps = [step_of_row(row) for row in await io(store.train_steps, run_id)]

        def point(s) -> dict:
            return {"step": s.step, "time": s.time or None, "loss_sum": number(s.loss_sum), "tokens": s.tokens,
                    "loss_per_token": number(s.loss_sum / s.tokens) if s.tokens else None, "passes": s.passes,
                    "metrics": {k: number(v) for k, v in s.metrics.items()}}

        return {"training_run_id": run_id, "steps": [point(s) for s in steps],
                "pending": None if pending is None else point(pending)}

    return routes
