"""What every router of the API is built from: the engine, the store, the settings and the served models, with
the request helpers that need them (body parsing, session and checkpoint checks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from tx.api import bodies
from tx.api.common import ApiError, Tenant, io, owned, readable
from tx.api.config import ApiConfig, ServedModel
from tx.api.served import ServedModels
from tx.engine import paths
from tx.engine.engine import Engine
from tx.engine.ops import UserError
from tx.engine.store import Store


@dataclass(frozen=True)
class ApiContext:
    engine: Engine
    store: Store
    config: ApiConfig
    models: ServedModels  # the base models served; the first is the default

    async def read_body(self, request: Request) -> bytes:
        return await bodies.read_body(request, self.config.max_body_bytes, self.config.max_decompressed_bytes)

    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        return await bodies.validate(await self.read_body(request), model)

    async def active_session(self, session_id: str, who: Tenant) -> dict:
        session = owned(await io(self.store.session, session_id), who, f"session_id {session_id!r}")
        if session["status"] != "active":
            raise ApiError(410, f"session {session_id} is {session['status']}")
        return session

    def checkpoint_base(self, path: str, field: str) -> ServedModel:
        """The base model the checkpoint at tinker path `path` was trained on (its model's record). Blocking."""
        source = self.store.model(paths.parse_tinker_path(path, field)[0])
        return self.models.trained_on(source["base_model"] if source else None, f"{field} {path!r}")

    def checkpoint_location(self, path: str, kind: str, who: Tenant, field: str = "path") -> str:
        """Where the files of checkpoint `path` are, if `who` may read it (theirs, or published); another
        tenant's unpublished one answers 404 like a missing one. Blocking."""
        model_id, found_kind, name = paths.parse_tinker_path(path, field)
        if found_kind != kind:
            raise UserError(f"{field} {path!r} is a {found_kind} checkpoint; this call needs {kind}")
        return readable(self.store.checkpoint(model_id, kind, name), who, f"{field}: checkpoint {path}")["location"]
