"""Session routes of the Tinker API: create, heartbeat, finish, get and list. A session groups a client's
models and sampling sessions; a finished or expired one answers 410 to the calls that need it active."""

from __future__ import annotations

from fastapi import APIRouter, Request

from tx.api import schemas
from tx.api.common import ApiError, found, io, owned, page, tenant
from tx.api.context import ApiContext


def router(ctx: ApiContext) -> APIRouter:
    engine, store = ctx.engine, ctx.store
    routes = APIRouter()

    @routes.post("/api/v1/create_session")
    async def create_session(request: Request):
        body = await ctx.parse(request, schemas.CreateSession)
        session_id = await io(store.create_session, body.tags, body.user_metadata, body.sdk_version, body.display_name,
                              tenant(request).id)
        return {"session_id": session_id, "type": "create_session"}

    @routes.post("/api/v1/session_heartbeat")
    async def session_heartbeat(request: Request):
        body = await ctx.parse(request, schemas.SessionRef)
        owned(await io(store.session, body.session_id), tenant(request), f"session_id {body.session_id!r}")
        status = found(await io(store.heartbeat, body.session_id), f"session_id {body.session_id!r}")
        if status != "active":
            raise ApiError(410, f"session {body.session_id} is {status}")
        return {"type": "session_heartbeat"}

    @routes.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request):
        await ctx.parse(request, schemas.FinishSession)
        owned(await io(store.session, session_id), tenant(request), f"session_id {session_id!r}")
        if await io(store.end_session, session_id, "finished"):
            await io(engine.end_session, session_id)
        return {}

    @routes.get("/api/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request):
        session = owned(await io(store.session, session_id), tenant(request), f"session_id {session_id!r}")
        models, _ = await io(store.list_models, 1000, 0, session_id)
        return {"training_run_ids": [m["model_id"] for m in models],
                "sampler_ids": await io(store.sampling_session_ids, session_id),
                "user_metadata": session["user_metadata"], "display_name": session["display_name"]}

    @routes.get("/api/v1/sessions")
    async def list_sessions(request: Request, limit: int = 20, offset: int = 0):
        return {"sessions": await io(store.list_sessions, *page(limit, offset), tenant(request).filter)}

    return routes
