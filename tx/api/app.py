"""The Tinker HTTP API (as spoken by the `tinker` SDK 0.38) over the engine and the store: `create_app`
assembles one router per resource (`*_routes.py`) behind the error handlers and the API-key check.

Submit endpoints answer at once with a future id; results come from the `retrieve_future` long-poll
(`future_routes`); training requests are sequenced per model by `seq_id` (`training_routes`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tx.api import (
    admin_routes,
    console_routes,
    future_routes,
    run_routes,
    sampling_routes,
    session_routes,
    telemetry_routes,
    training_routes,
    weights_routes,
)
from tx.api.common import ApiError, Tenant
from tx.api.config import ApiConfig, ServedModel  # callers import these two from here too
from tx.api.context import ApiContext
from tx.api.served import ServedModels
from tx.engine.engine import Engine
from tx.engine.ops import UserError
from tx.engine.store import Store

# in registration order, which is the order FastAPI matches paths in
ROUTERS = (admin_routes, session_routes, training_routes, future_routes, run_routes, sampling_routes, weights_routes,
           telemetry_routes, console_routes)


async def api_error_response(_request: Request, e: ApiError) -> JSONResponse:
    headers = {"retry-after": "1"} if e.status == 429 else None
    return JSONResponse({"detail": str(e)}, status_code=e.status, headers=headers)


async def user_error_response(_request: Request, e: UserError) -> JSONResponse:
    return JSONResponse({"detail": str(e)}, status_code=400)


def auth_middleware(config: ApiConfig) -> Callable[[Request, Callable[[Request], Awaitable[Response]]],
                                                   Awaitable[Response]]:
    """The HTTP middleware that sets `request.state.tenant` from the X-API-Key header, or answers 401."""
    api_keys, admin_keys = set(config.api_keys), set(config.admin_api_keys)

    async def auth(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        # Every path but the health check needs a key, /docs and /openapi.json included: the schema is
        # for clients, and an unknown path answers 401 like a known one (routes are not probed for free).
        key = request.headers.get("x-api-key") or ""
        if not key and request.url.path == "/metrics":  # what Prometheus' scrape config sends
            scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
            key = credentials.strip() if scheme.lower() == "bearer" else ""
        if key in admin_keys:
            request.state.tenant = Tenant.of_key(key, admin=True)
        elif key in api_keys or config.no_auth:  # without auth each distinct key (even "") is a tenant
            request.state.tenant = Tenant.of_key(key)
        elif (request.url.path != "/api/v1/healthz" and not request.url.path.startswith(weights_routes.FILES_PREFIX)
              and not console_routes.is_console_path(request.url.path)):
            # (signed download URLs carry their own authority: an HMAC over path and expiry; the console's
            # static files hold no data: its page sends the key it signs in with on each API call)
            return JSONResponse({"detail": "missing or unknown X-API-Key"}, status_code=401)
        return await call_next(request)

    return auth


def create_app(engine: Engine, store: Store, config: ApiConfig, served: ServedModel,
               extra: Sequence[ServedModel] = ()) -> FastAPI:
    """`served`: the default base model; `extra`: more base models served beside it (chosen by base_model)."""
    ctx = ApiContext(engine, store, config, ServedModels([served, *extra]))
    app = FastAPI(title="tx: Tinker-compatible API", version="0.38")
    app.add_exception_handler(ApiError, api_error_response)
    app.add_exception_handler(UserError, user_error_response)
    app.middleware("http")(auth_middleware(config))
    for module in ROUTERS:
        app.include_router(module.router(ctx))
    return app
