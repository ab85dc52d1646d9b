"""The futures route of the Tinker API: `retrieve_future`, the long-poll every submit endpoint's answer
(a request id) is redeemed at. It waits up to `long_poll_s` for the result, then answers `try_again`."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tx.api import schemas
from tx.api.common import io, owned, tenant
from tx.api.context import ApiContext


def router(ctx: ApiContext) -> APIRouter:
    engine, store = ctx.engine, ctx.store
    routes = APIRouter()

    @routes.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        body = await ctx.parse(request, schemas.RetrieveFuture)
        row = owned(await io(store.future, body.request_id), tenant(request), f"request_id {body.request_id!r}")
        if row.status == "pending":
            loop = asyncio.get_running_loop()
            ready = asyncio.Event()

            def wake() -> None:
                loop.call_soon_threadsafe(ready.set)

            await io(engine.watch, body.request_id, wake)
            try:
                row = await io(store.future, body.request_id)  # it may have finished before we watched
                if row.status == "pending":
                    try:
                        await asyncio.wait_for(ready.wait(), ctx.config.long_poll_s)
                    except TimeoutError:
                        pass
                    row = await io(store.future, body.request_id)
            finally:
                await io(engine.unwatch, body.request_id, wake)
        if row.status == "pending":
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        return Response(row.result, media_type=row.content_type)

    return routes
