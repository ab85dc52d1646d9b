"""The Tinker HTTP API (as spoken by the `tinker` SDK 0.38) over the engine and the store.

Submit endpoints answer at once with a future id; results come from the `retrieve_future` long-poll.
Training requests are sequenced per model by `seq_id`: a request refused at submit (HTTP 400) still
takes its place in that order, so the model's later requests are not held up by it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from tx import losses, types
from tx.api import bodies, schemas, stability, weights_routes, wire, wire_json
from tx.api.common import ApiError, Tenant, found, owned, page, readable, str_metadata, tenant
from tx.api.config import TINKER_LORA_ALPHA, ApiConfig, ServedModel  # noqa: F401 - ApiConfig re-exported
from tx.api.runs import add_run_routes
from tx.api.sampling_routes import add_sampling_routes
from tx.api.served import ServedModels
from tx.engine import paths
from tx.engine.engine import Engine
from tx.engine.ops import (
    CreateFromStateRequest,
    CreateRequest,
    LoadRequest,
    RequestTooLarge,
    SaveRequest,
    UserError,
)
from tx.engine.store import Store
from tx.runtime import compile_cache_stats

logger = logging.getLogger(__name__)


def create_app(engine: Engine, store: Store, config: ApiConfig, served: ServedModel,
               extra: Sequence[ServedModel] = ()) -> FastAPI:
    """`served`: the default base model; `extra`: more base models served beside it (chosen by base_model)."""
    models = ServedModels([served, *extra])
    app = FastAPI(title="tx: Tinker-compatible API", version="0.38")
    io = run_in_threadpool  # store calls block; keep them off the event loop
    api_keys, admin_keys = set(config.api_keys), set(config.admin_api_keys)

    # ---- plumbing: errors, auth, bodies ----

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, e: ApiError):
        headers = {"retry-after": "1"} if e.status == 429 else None
        return JSONResponse({"detail": str(e)}, status_code=e.status, headers=headers)

    @app.exception_handler(UserError)
    async def _user_error(_request: Request, e: UserError):
        return JSONResponse({"detail": str(e)}, status_code=400)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        # Every path but the health check needs a key, /docs and /openapi.json included: the schema is
        # for clients, and an unknown path answers 401 like a known one (routes are not probed for free).
        key = request.headers.get("x-api-key") or ""
        if key in admin_keys:
            request.state.tenant = Tenant.of_key(key, admin=True)
        elif key in api_keys or config.no_auth:  # without auth each distinct key (even "") is a tenant
            request.state.tenant = Tenant.of_key(key)
        elif request.url.path != "/api/v1/healthz" and not request.url.path.startswith(weights_routes.FILES_PREFIX):
            # (signed download URLs carry their own authority: an HMAC over path and expiry)
            return JSONResponse({"detail": "missing or unknown X-API-Key"}, status_code=401)
        return await call_next(request)

    async def read_body(request: Request) -> bytes:
        return await bodies.read_body(request, config.max_body_bytes, config.max_decompressed_bytes)

    validate = bodies.validate

    async def parse(request: Request, model: type[BaseModel]) -> Any:
        return await validate(await read_body(request), model)

    async def parse_sequenced(request: Request, model: type[BaseModel], who: Tenant) -> Any:
        """`parse` for a model's sequenced request: a body that fails validation but names a live model of
        `who` and a seq_id still consumes that seq_id, so the model's later requests are not held up."""
        body = await read_body(request)
        try:
            return await validate(body, model)
        except ApiError as error:
            head = bodies.sequence_of(body)
            if head is not None and (row := await io(store.model, head[0])) is not None and who.sees(row["owner"]):
                try:
                    await io(engine.submit, "rejected", str(error), f"train:{head[0]}:{head[1]}", *head, owner=who.id)
                except UserError:  # not loaded, or that seq_id already ran: nothing to consume
                    pass
            raise

    async def live_model(model_id: str, who: Tenant) -> dict:
        model = owned(await io(store.model, model_id), who, f"model_id {model_id!r}")
        if model["status"] not in ("creating", "ready"):
            raise ApiError(400, f"model_id {model_id!r} is {model['status']}; create it again (e.g. from a "
                                "checkpoint with create_training_client_from_state)")
        return model

    async def active_session(session_id: str, who: Tenant) -> dict:
        session = owned(await io(store.session, session_id), who, f"session_id {session_id!r}")
        if session["status"] != "active":
            raise ApiError(410, f"session {session_id} is {session['status']}")
        return session

    check_base_model = models.find  # the served model a request names (None: the default); unknown: 400

    def checkpoint_base(path: str, field: str) -> ServedModel:
        """The base model the checkpoint at tinker path `path` was trained on (its model's record)."""
        source = store.model(paths.parse_tinker_path(path, field)[0])
        return models.trained_on(source["base_model"] if source else None, f"{field} {path!r}")

    async def submit_training(model_id: str, seq_id: int, kind: str, build: Callable[[], Any], who: Tenant,
                              size: int = 1, session_id: str | None = None, tokens: int = 0) -> dict:
        """Submit a sequenced op; if `build` (run in a worker thread) refuses the request, its seq_id is
        still consumed."""
        key = f"train:{model_id}:{seq_id}"
        try:
            payload = await io(build)
        except (UserError, ValidationError, ApiError) as e:
            await io(engine.submit, "rejected", str(e), key, model_id, seq_id, owner=who.id)
            status = e.status if isinstance(e, ApiError) else 413 if isinstance(e, RequestTooLarge) else 400
            raise ApiError(status, str(e)) from None
        request_id = await io(engine.submit, kind, payload, key, model_id, seq_id, session_id, size, tokens,
                              owner=who.id)
        return {"request_id": request_id, "model_id": model_id}

    def checkpoint_location(path: str, kind: str, who: Tenant, field: str = "path") -> str:
        """Where the files of checkpoint `path` are, if `who` may read it (theirs, or published); another
        tenant's unpublished one answers 404 like a missing one."""
        model_id, found_kind, name = paths.parse_tinker_path(path, field)
        if found_kind != kind:
            raise UserError(f"{field} {path!r} is a {found_kind} checkpoint; this call needs {kind}")
        return readable(store.checkpoint(model_id, kind, name), who, f"{field}: checkpoint {path}")["location"]

    # ---- configuration, sessions, telemetry ----

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        await read_body(request)
        # the SDK splits a forward_backward into requests of at most these sizes; at 4 bytes or more per
        # token in its estimate, a request then holds at most max_request_tokens tokens
        limits = {"fwdbwd_max_chunk_len": min(1024, engine.config.max_pass_datums),
                  "fwdbwd_max_chunk_bytes_count": min(5_000_000, 4 * engine.config.max_request_tokens)}
        # proto_write_fwdbwd / fwd_via_fwdbwd: SDKs 0.22-0.24 send protobuf forward(_backward) bodies only when told
        return {**limits, "pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": config.compress_fwdbwd,
                "proto_write_fwdbwd": True, "fwd_via_fwdbwd": True,
                "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                "sample_join_sampling_session": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request):
        await read_body(request)
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        body = await parse(request, schemas.CreateSession)
        session_id = await io(store.create_session, body.tags, body.user_metadata, body.sdk_version, body.display_name,
                              tenant(request).id)
        return {"session_id": session_id, "type": "create_session"}

    @app.post("/api/v1/session_heartbeat")
    async def session_heartbeat(request: Request):
        body = await parse(request, schemas.SessionRef)
        owned(await io(store.session, body.session_id), tenant(request), f"session_id {body.session_id!r}")
        status = found(await io(store.heartbeat, body.session_id), f"session_id {body.session_id!r}")
        if status != "active":
            raise ApiError(410, f"session {body.session_id} is {status}")
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request):
        await parse(request, schemas.FinishSession)
        owned(await io(store.session, session_id), tenant(request), f"session_id {session_id!r}")
        if await io(store.end_session, session_id, "finished"):
            await io(engine.end_session, session_id)
        return {}

    @app.get("/api/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request):
        session = owned(await io(store.session, session_id), tenant(request), f"session_id {session_id!r}")
        models, _ = await io(store.list_models, 1000, 0, session_id)
        return {"training_run_ids": [m["model_id"] for m in models],
                "sampler_ids": await io(store.sampling_session_ids, session_id),
                "user_metadata": session["user_metadata"], "display_name": session["display_name"]}

    @app.get("/api/v1/sessions")
    async def list_sessions(request: Request, limit: int = 20, offset: int = 0):
        return {"sessions": await io(store.list_sessions, *page(limit, offset), tenant(request).filter)}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request):
        await read_body(request)  # accepted and dropped
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": m.model_name, "max_context_length": m.max_context_length,
                                      "trainable": True, "sampleable": True, "training_mode": m.training_mode}
                                     for m in models.all]}

    @app.get("/api/v1/metrics")
    async def metrics():
        backend = engine.backend.metrics
        return {"engine": dict(engine.metrics), "backend_compiles": backend.compiles, "backend_calls": backend.calls,
                "backend_tokens_real": backend.tokens_real, "backend_tokens_padded": backend.tokens_padded,
                "backend_sampling": backend.sampling,
                "backend_calls_by_base_model": {name: b.metrics.calls for name, b in engine.backends.items()},
                "compile_cache": compile_cache_stats()}

    # ---- training ----

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        body = await parse(request, schemas.CreateModel)
        who = tenant(request)
        await active_session(body.session_id, who)
        base = check_base_model(body.base_model)
        if body.optimizer_config.type != "adamw":
            raise ApiError(400, f"optimizer_config.type {body.optimizer_config.type!r} is not supported (adamw only)")
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
            lora_config = types.LoraConfig(rank=lora.rank, alpha=TINKER_LORA_ALPHA, seed=lora.seed,
                                           train_attn=lora.train_attn, train_mlp=lora.train_mlp,
                                           train_unembed=lora.train_unembed)
        except ValidationError as e:
            err = e.errors()[0]
            where = "".join(f".{part}" for part in err["loc"])
            raise ApiError(400, f"lora_config{where} = {err.get('input')!r}: {err['msg']}") from None
        model_id = paths.model_id_of(body.session_id, body.model_seq_id)
        key = f"create:{body.session_id}:{body.model_seq_id}"
        if (known := await io(store.future_by_key, key)) is not None:
            return {"request_id": known, "model_id": model_id}
        if await io(store.model, model_id) is not None:
            raise ApiError(400, f"model_seq_id {body.model_seq_id} of session {body.session_id} is already used")
        await io(store.add_model, model_id, body.session_id, base.model_name, lora_config.model_dump(),
                 body.user_metadata or {}, who.id)
        request_id = await io(engine.submit, "create_model", CreateRequest(lora_config, base_model=base.model_name),
                              key, model_id, 0, body.session_id, owner=who.id)
        return {"request_id": request_id, "model_id": model_id}

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        body = await parse(request, schemas.ModelRef)
        model = owned(await io(store.model, body.model_id), tenant(request), f"model_id {body.model_id!r}")
        base = models.trained_on(model["base_model"], f"model_id {body.model_id!r}")
        return {"model_id": body.model_id, "model_name": base.model_name, "is_lora": True,
                "lora_rank": model["lora_config"]["rank"], "optimizer_config": {"type": "adamw"}, "type": "get_info",
                "model_data": {"arch": base.arch, "model_name": base.model_name, "tokenizer_id": base.tokenizer_id}}

    @app.post("/api/v1/forward_backward")
    @app.post("/api/v1/forward")  # SDKs before 0.22 send forward passes here, as JSON
    async def forward_backward(request: Request):
        msg = await wire_json.decode_pass(await read_body(request), request.headers.get("content-type", ""),
                                          request.url.path.endswith("/forward"))
        head = wire.envelope(msg)  # model and seq_id first: a bad datum below still consumes the seq_id
        who = tenant(request)
        await live_model(head.model_id, who)
        tokens = wire.token_count(msg)

        def build():
            if msg.loss_fn not in losses.names():
                raise UserError(f"loss_fn {msg.loss_fn!r} is not supported; available: {', '.join(losses.names())}")
            engine.check_pass_size(len(msg.data), tokens)  # before decoding: a huge request is refused cheaply
            return stability.attach(wire.pass_request(msg), msg, store.future, who.sees)

        kind = "forward" if head.forward_only else "forward_backward"
        return await submit_training(head.model_id, head.seq_id, kind, build, who, size=max(1, head.num_datums),
                                     tokens=tokens)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        who = tenant(request)
        body = await parse_sequenced(request, schemas.OptimStep, who)
        await live_model(body.model_id, who)

        def build():
            if body.adam_params is None:
                raise UserError("only AdamW is supported: send adam_params")
            return types.AdamParams(**body.adam_params.model_dump())

        return await submit_training(body.model_id, body.seq_id, "optim_step", build, who)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        who = tenant(request)
        body = await parse_sequenced(request, schemas.SaveWeights, who)
        await live_model(body.model_id, who)
        return await submit_training(body.model_id, body.seq_id, "save_weights", lambda: SaveRequest(
            paths.check_name(body.path), schemas.check_ttl(body.ttl_seconds), str_metadata(body.user_metadata)), who)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        who = tenant(request)
        body = await parse_sequenced(request, schemas.SaveWeightsForSampler, who)
        model = await live_model(body.model_id, who)

        def build():
            if body.path is not None:
                return SaveRequest(paths.check_name(body.path), schemas.check_ttl(body.ttl_seconds),
                                   str_metadata(body.user_metadata))
            if body.sampling_session_seq_id is None:
                raise UserError("save_weights_for_sampler needs either path or sampling_session_seq_id")
            sid = paths.sampling_session_id_of(model["session_id"], body.sampling_session_seq_id)
            return SaveRequest(None, sampling_session_id=sid)

        return await submit_training(body.model_id, body.seq_id, "save_weights_for_sampler", build, who,
                                     session_id=model["session_id"])

    @app.post("/api/v1/save_weights_external")
    async def save_weights_external(request: Request):
        who = tenant(request)
        body = await parse_sequenced(request, schemas.SaveWeightsExternal, who)
        await live_model(body.model_id, who)
        return await submit_training(body.model_id, body.seq_id, "save_weights_external",
                                     lambda: weights_routes.external_save_request(body), who)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        who = tenant(request)
        body = await parse_sequenced(request, schemas.LoadWeights, who)
        if body.model_id is not None:  # legacy in-place load, sequenced like any training op
            if body.seq_id is None:
                raise ApiError(400, "load_weights with model_id needs seq_id")
            model = await live_model(body.model_id, who)

            def build():
                location = checkpoint_location(body.path, "weights", who)
                models.matching(model["base_model"], checkpoint_base(body.path, "path"), f"path {body.path!r}",
                                f"model {body.model_id}'s base model")
                return LoadRequest(location, body.optimizer)

            return await submit_training(body.model_id, body.seq_id, "load_weights", build, who)
        if body.session_id is None or body.model_seq_id is None:
            raise ApiError(400, "load_weights needs model_id and seq_id, or session_id and model_seq_id")
        await active_session(body.session_id, who)
        check_base_model(body.base_model)  # a name this server does not serve is refused before the path is read
        model_id = paths.model_id_of(body.session_id, body.model_seq_id)
        key = f"create:{body.session_id}:{body.model_seq_id}"
        if (known := await io(store.future_by_key, key)) is not None:
            return {"request_id": known, "model_id": model_id}
        source_id = paths.parse_tinker_path(body.path)[0]
        location = await io(checkpoint_location, body.path, "weights", who)
        base = models.matching(body.base_model, await io(checkpoint_base, body.path, "path"), f"path {body.path!r}")
        source = await io(store.model, source_id)
        if await io(store.model, model_id) is not None:
            raise ApiError(400, f"model_seq_id {body.model_seq_id} of session {body.session_id} is already used")
        await io(store.add_model, model_id, body.session_id, base.model_name,
                 source["lora_config"] if source else {}, body.user_metadata or (source or {}).get("user_metadata") or {},
                 who.id)
        request = CreateFromStateRequest(location, body.optimizer, base_model=base.model_name)
        request_id = await io(engine.submit, "create_from_state", request, key, model_id, 0, body.session_id,
                              owner=who.id)
        return {"request_id": request_id, "model_id": model_id}

    @app.post("/api/v1/unload_model")
    async def unload_model(request: Request):
        body = await parse(request, schemas.ModelRef)
        who = tenant(request)
        await live_model(body.model_id, who)
        request_id = await io(engine.submit, "unload_model", None, f"unload:{body.model_id}", body.model_id,
                              owner=who.id)
        return {"request_id": request_id, "model_id": body.model_id}

    # ---- futures ----

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        body = await parse(request, schemas.RetrieveFuture)
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
                        await asyncio.wait_for(ready.wait(), config.long_poll_s)
                    except TimeoutError:
                        pass
                    row = await io(store.future, body.request_id)
            finally:
                await io(engine.unwatch, body.request_id, wake)
        if row.status == "pending":
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        return Response(row.result, media_type=row.content_type)

    add_run_routes(app, store, engine, parse)
    add_sampling_routes(app, engine, store, models, parse, active_session, checkpoint_location, checkpoint_base)
    weights_routes.add_weights_routes(app, store, engine, config, parse)

    return app

