"""Model routes of the Tinker API: create_model, get_info, forward(_backward), optim_step, save_weights(_for_sampler,
_external), load_weights, unload_model.

Training requests are sequenced per model by `seq_id`: a request refused at submit (HTTP 400) still takes its
place in that order, so the model's later requests are not held up by it. A create (create_model, or
load_weights into a new model) is keyed by (session_id, model_seq_id): a resend answers the first future.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError

from tx import losses, types
from tx.api import bodies, schemas, stability, weights_routes, wire, wire_json
from tx.api.common import ApiError, Tenant, io, owned, str_metadata, tenant
from tx.api.config import TINKER_LORA_ALPHA, ServedModel
from tx.api.context import ApiContext
from tx.engine import paths
from tx.engine.ops import (
    CreateFromStateRequest,
    CreateRequest,
    LoadRequest,
    RequestTooLarge,
    SaveRequest,
    UserError,
)

logger = logging.getLogger(__name__)


async def parse_sequenced(ctx: ApiContext, request: Request, model: type[BaseModel], who: Tenant) -> Any:
    """`ctx.parse` for a model's sequenced request: a body that fails validation but names a live model of
    `who` and a seq_id still consumes that seq_id, so the model's later requests are not held up."""
    body = await ctx.read_body(request)
    try:
        return await bodies.validate(body, model)
    except ApiError as error:
        head = bodies.sequence_of(body)
        if head is not None and (row := await io(ctx.store.model, head[0])) is not None and who.sees(row["owner"]):
            try:
                await io(ctx.engine.submit, "rejected", str(error), f"train:{head[0]}:{head[1]}", *head, owner=who.id)
            except UserError:  # not loaded, or that seq_id already ran: nothing to consume
                pass
        raise


async def live_model(ctx: ApiContext, model_id: str, who: Tenant) -> dict:
    """The store row of `who`'s model `model_id`, which must be creating or ready (not unloaded or failed)."""
    model = owned(await io(ctx.store.model, model_id), who, f"model_id {model_id!r}")
    if model["status"] not in ("creating", "ready"):
        raise ApiError(400, f"model_id {model_id!r} is {model['status']}; create it again (e.g. from a "
                            "checkpoint with create_training_client_from_state)")
    return model


async def submit_training(ctx: ApiContext, model_id: str, seq_id: int, kind: str, build: Callable[[], Any],
                          who: Tenant, size: int = 1, session_id: str | None = None, tokens: int = 0) -> dict:
    """Submit a sequenced op; if `build` (run in a worker thread) refuses the request, its seq_id is
    still consumed."""
    key = f"train:{model_id}:{seq_id}"
    try:
        payload = await io(build)
    except (UserError, ValidationError, ApiError) as e:
        await io(ctx.engine.submit, "rejected", str(e), key, model_id, seq_id, owner=who.id)
        status = e.status if isinstance(e, ApiError) else 413 if isinstance(e, RequestTooLarge) else 400
        raise ApiError(status, str(e)) from None
    request_id = await io(ctx.engine.submit, kind, payload, key, model_id, seq_id, session_id, size, tokens,
                          owner=who.id)
    return {"request_id": request_id, "model_id": model_id}


def create_key(session_id: str, model_seq_id: int) -> str:
    return f"create:{session_id}:{model_seq_id}"


async def resent_create(ctx: ApiContext, session_id: str, model_seq_id: int) -> dict | None:
    """The first answer again if this create was sent before (a client's retry), else None."""
    known = await io(ctx.store.future_by_key, create_key(session_id, model_seq_id))
    return None if known is None else {"request_id": known, "model_id": paths.model_id_of(session_id, model_seq_id)}


async def add_model(ctx: ApiContext, who: Tenant, session_id: str, model_seq_id: int, base_model: str,
                    lora_config: dict, user_metadata: dict, kind: str, request: Any) -> dict:
    """Record model `model_seq_id` of the session and submit the op `kind` that creates it."""
    model_id = paths.model_id_of(session_id, model_seq_id)
    if await io(ctx.store.model, model_id) is not None:
        raise ApiError(400, f"model_seq_id {model_seq_id} of session {session_id} is already used")
    await io(ctx.store.add_model, model_id, session_id, base_model, lora_config, user_metadata, who.id)
    request_id = await io(ctx.engine.submit, kind, request, create_key(session_id, model_seq_id), model_id, 0,
                          session_id, owner=who.id)
    return {"request_id": request_id, "model_id": model_id}


def lora_config_of(body: schemas.CreateModel, base: ServedModel) -> types.LoraConfig:
    """The adapter config of a create_model request, checked against the served model (400 naming the field)."""
    lora = body.lora_config
    if base.training_mode == "full":
        if lora.rank:
            logger.info("create_model on a training_mode='full' server: lora_config.rank %d ignored, every "
                        "weight is trained", lora.rank)
    elif lora.rank == 0:
        raise ApiError(400, "lora_config.rank 0 (full training) is not served here: this server trains LoRA "
                            "adapters; full training needs a server started with --training-mode full")
    elif lora.rank > base.max_lora_rank:
        raise ApiError(400, f"lora_config.rank {lora.rank} exceeds this server's max_lora_rank {base.max_lora_rank}")
    try:
        return types.LoraConfig(rank=lora.rank, alpha=TINKER_LORA_ALPHA, seed=lora.seed, train_attn=lora.train_attn,
                                train_mlp=lora.train_mlp, train_unembed=lora.train_unembed)
    except ValidationError as e:
        err = e.errors()[0]
        where = "".join(f".{part}" for part in err["loc"])
        raise ApiError(400, f"lora_config{where} = {err.get('input')!r}: {err['msg']}") from None


def router(ctx: ApiContext) -> APIRouter:
    engine, store, models = ctx.engine, ctx.store, ctx.models
    routes = APIRouter()

    @routes.post("/api/v1/create_model")
    async def create_model(request: Request):
        body = await ctx.parse(request, schemas.CreateModel)
        who = tenant(request)
        await ctx.active_session(body.session_id, who)
        base = models.find(body.base_model)
        if body.optimizer_config.type != "adamw":
            raise ApiError(400, f"optimizer_config.type {body.optimizer_config.type!r} is not supported (adamw only)")
        lora_config = lora_config_of(body, base)
        if (resent := await resent_create(ctx, body.session_id, body.model_seq_id)) is not None:
            return resent
        return await add_model(ctx, who, body.session_id, body.model_seq_id, base.model_name, lora_config.model_dump(),
                               body.user_metadata or {}, "create_model",
                               CreateRequest(lora_config, base_model=base.model_name))

    @routes.post("/api/v1/get_info")
    async def get_info(request: Request):
        body = await ctx.parse(request, schemas.ModelRef)
        model = owned(await io(store.model, body.model_id), tenant(request), f"model_id {body.model_id!r}")
        base = models.trained_on(model["base_model"], f"model_id {body.model_id!r}")
        return {"model_id": body.model_id, "model_name": base.model_name, "is_lora": True,
                "lora_rank": model["lora_config"]["rank"], "optimizer_config": {"type": "adamw"}, "type": "get_info",
                "model_data": {"arch": base.arch, "model_name": base.model_name, "tokenizer_id": base.tokenizer_id}}

    @routes.post("/api/v1/forward_backward")
    @routes.post("/api/v1/forward")  # SDKs before 0.22 send forward passes here, as JSON
    async def forward_backward(request: Request):
        msg = await wire_json.decode_pass(await ctx.read_body(request), request.headers.get("content-type", ""),
                                          request.url.path.endswith("/forward"))
        head = wire.envelope(msg)  # model and seq_id first: a bad datum below still consumes the seq_id
        who = tenant(request)
        await live_model(ctx, head.model_id, who)
        tokens = wire.token_count(msg)

        def build():
            if msg.loss_fn not in losses.names():
                raise UserError(f"loss_fn {msg.loss_fn!r} is not supported; available: {', '.join(losses.names())}")
            engine.check_pass_size(len(msg.data), tokens)  # before decoding: a huge request is refused cheaply
            return stability.attach(wire.pass_request(msg), msg, store.future, who.sees)

        kind = "forward" if head.forward_only else "forward_backward"
        return await submit_training(ctx, head.model_id, head.seq_id, kind, build, who, size=max(1, head.num_datums),
                                     tokens=tokens)

    @routes.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        who = tenant(request)
        body = await parse_sequenced(ctx, request, schemas.OptimStep, who)
        await live_model(ctx, body.model_id, who)

        def build():
            if body.adam_params is None:
                raise UserError("only AdamW is supported: send adam_params")
            return types.AdamParams(**body.adam_params.model_dump())

        return await submit_training(ctx, body.model_id, body.seq_id, "optim_step", build, who)

    @routes.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        who = tenant(request)
        body = await parse_sequenced(ctx, request, schemas.SaveWeights, who)
        await live_model(ctx, body.model_id, who)
        return await submit_training(ctx, body.model_id, body.seq_id, "save_weights", lambda: SaveRequest(
            paths.check_name(body.path), schemas.check_ttl(body.ttl_seconds), str_metadata(body.user_metadata)), who)

    @routes.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        who = tenant(request)
        body = await parse_sequenced(ctx, request, schemas.SaveWeightsForSampler, who)
        model = await live_model(ctx, body.model_id, who)

        def build():
            if body.path is not None:
                return SaveRequest(paths.check_name(body.path), schemas.check_ttl(body.ttl_seconds),
                                   str_metadata(body.user_metadata))
            if body.sampling_session_seq_id is None:
                raise UserError("save_weights_for_sampler needs either path or sampling_session_seq_id")
            sid = paths.sampling_session_id_of(model["session_id"], body.sampling_session_seq_id)
            return SaveRequest(None, sampling_session_id=sid)

        return await submit_training(ctx, body.model_id, body.seq_id, "save_weights_for_sampler", build, who,
                                     session_id=model["session_id"])

    @routes.post("/api/v1/save_weights_external")
    async def save_weights_external(request: Request):
        who = tenant(request)
        body = await parse_sequenced(ctx, request, schemas.SaveWeightsExternal, who)
        await live_model(ctx, body.model_id, who)
        return await submit_training(ctx, body.model_id, body.seq_id, "save_weights_external",
                                     lambda: weights_routes.external_save_request(body), who)

    @routes.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        who = tenant(request)
        body = await parse_sequenced(ctx, request, schemas.LoadWeights, who)
        if body.model_id is not None:  # legacy in-place load, sequenced like any training op
            if body.seq_id is None:
                raise ApiError(400, "load_weights with model_id needs seq_id")
            model = await live_model(ctx, body.model_id, who)

            def build():
                location = ctx.checkpoint_location(body.path, "weights", who)
                models.matching(model["base_model"], ctx.checkpoint_base(body.path, "path"), f"path {body.path!r}",
                                f"model {body.model_id}'s base model")
                return LoadRequest(location, body.optimizer)

            return await submit_training(ctx, body.model_id, body.seq_id, "load_weights", build, who)
        if body.session_id is None or body.model_seq_id is None:
            raise ApiError(400, "load_weights needs model_id and seq_id, or session_id and model_seq_id")
        await ctx.active_session(body.session_id, who)
        models.find(body.base_model)  # a name this server does not serve is refused before the path is read
        if (resent := await resent_create(ctx, body.session_id, body.model_seq_id)) is not None:
            return resent
        source_id = paths.parse_tinker_path(body.path)[0]
        location = await io(ctx.checkpoint_location, body.path, "weights", who)
        base = models.matching(body.base_model, await io(ctx.checkpoint_base, body.path, "path"), f"path {body.path!r}")
        source = await io(store.model, source_id)
        return await add_model(ctx, who, body.session_id, body.model_seq_id, base.model_name,
                               source["lora_config"] if source else {},
                               body.user_metadata or (source or {}).get("user_metadata") or {}, "create_from_state",
                               CreateFromStateRequest(location, body.optimizer, base_model=base.model_name))

    @routes.post("/api/v1/unload_model")
    async def unload_model(request: Request):
        body = await ctx.parse(request, schemas.ModelRef)
        who = tenant(request)
        await live_model(ctx, body.model_id, who)
        request_id = await io(engine.submit, "unload_model", None, f"unload:{body.model_id}", body.model_id,
                              owner=who.id)
        return {"request_id": request_id, "model_id": body.model_id}

    return routes
