"""REST endpoints for training runs and checkpoints (RestClient, the cookbook, the tinker CLI)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from tx.api import schemas
from tx.api.common import Tenant, checkpoint_key, found, io, iso, owned, page, readable, str_metadata, tenant
from tx.api.context import ApiContext
from tx.engine import paths


def router(ctx: ApiContext) -> APIRouter:
    engine, store = ctx.engine, ctx.store
    routes = APIRouter()

    @routes.post("/api/v1/weights_info")
    async def weights_info(request: Request):
        body = await ctx.parse(request, schemas.WeightsInfo)
        model_id, kind, name = paths.parse_tinker_path(body.tinker_path, "tinker_path")
        what = f"checkpoint {body.tinker_path}"
        readable(await io(store.checkpoint, model_id, kind, name), tenant(request), what)  # published: anyone's
        model = found(await io(store.model, model_id), what)
        lora = model["lora_config"]
        return {"base_model": model["base_model"], "optimizer_config": {"type": "adamw"}, "is_lora": True,
                "lora_rank": lora.get("rank"), "train_unembed": lora.get("train_unembed"),
                "train_mlp": lora.get("train_mlp"), "train_attn": lora.get("train_attn")}

    # ---- training runs and checkpoints ----

    def checkpoint_json(row: dict) -> dict:
        return {"checkpoint_id": f"{row['kind']}/{row['name']}", "checkpoint_type": paths.KINDS[row["kind"]],
                "time": iso(row["created_at"]), "tinker_path": paths.tinker_path(row["model_id"], row["kind"], row["name"]),
                "size_bytes": row["size_bytes"], "public": bool(row.get("public")), "user_metadata": str_metadata(row["user_metadata"]),
                "expires_at": iso(row["expires_at"])}

    def training_run_json(model: dict) -> dict:
        checkpoints, _ = store.list_checkpoints(model["model_id"])
        last = {kind: next((checkpoint_json(c) for c in checkpoints if c["kind"] == kind), None) for kind in paths.KINDS}
        return {"training_run_id": model["model_id"], "base_model": model["base_model"],
                "model_owner": model["session_id"], "is_lora": True, "corrupted": False,
                "lora_rank": model["lora_config"].get("rank"), "last_request_time": iso(model["last_request_time"]),
                "last_checkpoint": last["weights"], "last_sampler_checkpoint": last["sampler_weights"],
                "user_metadata": str_metadata(model["user_metadata"])}

    def run_or_404(run_id: str, who: Tenant) -> dict:
        return owned(store.model(run_id), who, f"training run {run_id!r}")

    @routes.get("/api/v1/training_runs")
    async def list_training_runs(request: Request, limit: int = 20, offset: int = 0):
        models, total = await io(store.list_models, *page(limit, offset), None, tenant(request).filter)
        runs = [await io(training_run_json, m) for m in models]
        return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    @routes.get("/api/v1/training_runs/{run_id}")
    async def get_training_run(run_id: str, request: Request):
        return await io(training_run_json, await io(run_or_404, run_id, tenant(request)))

    @routes.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def list_run_checkpoints(run_id: str, request: Request):
        await io(run_or_404, run_id, tenant(request))
        rows, total = await io(store.list_checkpoints, run_id)
        return {"checkpoints": [checkpoint_json(r) for r in rows],
                "cursor": {"offset": 0, "limit": len(rows), "total_count": total}}

    @routes.get("/api/v1/checkpoints")
    async def list_all_checkpoints(request: Request, limit: int = 100, offset: int = 0):
        rows, total = await io(store.list_checkpoints, None, *page(limit, offset), tenant(request).filter)
        return {"checkpoints": [checkpoint_json(r) for r in rows],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    @routes.delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(run_id: str, kind: str, name: str, request: Request):
        key = checkpoint_key(run_id, kind, name)
        row = owned(await io(store.checkpoint, *key), tenant(request), f"checkpoint {kind}/{name} of {run_id}")
        await io(store.delete_checkpoint, *key)
        await io(engine.delete_checkpoint_files, row["location"])
        return {}

    @routes.put("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
    async def set_ttl(run_id: str, kind: str, name: str, request: Request):
        body = await ctx.parse(request, schemas.CheckpointTtl)
        key = checkpoint_key(run_id, kind, name)
        what = f"checkpoint {kind}/{name} of {run_id}"
        owned(await io(store.checkpoint, *key), tenant(request), what)
        expires = None if body.ttl_seconds is None else time.time() + body.ttl_seconds
        found(await io(store.set_checkpoint_expiry, *key, expires) or None, what)
        return {}

    return routes
