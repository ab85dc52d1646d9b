"""Sampling routes of the Tinker API: create_sampling_session, samplers/{id}, asample.

asample answers at once with the future id and `sample_sequence_ids`: one id per sample,
"{request_id}:{i}". The SDK (0.38, sampling_client._attach_sequence_ids) stamps them on the returned
sequences as `SampledSequence.sequence_id` ("session-scoped identifier, distinct per sequence"); a resend of
the same (sampling_session_id, seq_id) answers the same future and so the same ids.

The SDK >= 0.32 fields (topk_sample_logprobs, target_prompt_logprobs, prompt_alt_tokens_k,
prompt_logprobs_last_n) are checked here against the served model's limits (400 naming the field and the
value) and again by the backend (tx.sampling.requests.check_options), which computes them.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import ValidationError

from tx import types
from tx.api import schemas
from tx.api.common import ApiError, io, owned, tenant
from tx.api.config import ServedModel
from tx.api.context import ApiContext
from tx.engine import paths
from tx.engine.ops import SampleRequest
from tx.sampling.requests import SampleLimits, check_options

UNBOUNDED = 2**31 - 1  # a limit this API does not know (ServedModel field 0): the backend checks it


def target_ids(body: schemas.TensorBody) -> types.TargetPromptIds:
    """The JSON TensorData of target_prompt_logprobs as TargetPromptIds (its layout: tx.sampling.targets)."""
    field = "target_prompt_logprobs"
    if body.dtype != "int64":
        raise ApiError(400, f"{field}.dtype {body.dtype!r} must be 'int64' (token ids)")
    if body.shape is None or len(body.shape) != 2:
        raise ApiError(400, f"{field}.shape {body.shape} must be 2-D, [len(prompt) - 1, K]")
    if any(not isinstance(v, int) for v in body.data):
        raise ApiError(400, f"{field}.data must hold integer token ids")
    try:
        return types.TargetPromptIds(shape=tuple(body.shape), ids=body.data, crow=body.sparse_crow_indices,
                                     col=body.sparse_col_indices)
    except ValidationError as e:
        raise ApiError(400, f"{field}: {e.errors()[0]['msg']}") from None


def sample_options(body: schemas.Sample, prompt_len: int, served: ServedModel) -> types.SampleOptions:
    options = types.SampleOptions(
        topk_sample_logprobs=body.topk_sample_logprobs, prompt_alt_tokens_k=body.prompt_alt_tokens_k,
        prompt_logprobs_last_n=body.prompt_logprobs_last_n,
        target_prompt_logprobs=None if body.target_prompt_logprobs is None else target_ids(body.target_prompt_logprobs))
    limits = SampleLimits(vocab=served.vocab_size or UNBOUNDED, max_seq_len=served.max_context_length,
                          max_num_samples=served.max_num_samples, eos_ids=(),
                          max_topk_prompt_logprobs=served.max_topk_logprobs or UNBOUNDED,
                          max_target_prompt_logprobs=served.max_target_prompt_logprobs or UNBOUNDED)
    try:
        check_options(options, prompt_len, body.prompt_logprobs, limits)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    return options


def router(ctx: ApiContext) -> APIRouter:
    """Requests run on the base model they name, or the one their checkpoint was trained on (`ctx.models`)."""
    engine, store, models = ctx.engine, ctx.store, ctx.models
    checkpoint_location, checkpoint_base = ctx.checkpoint_location, ctx.checkpoint_base
    routes = APIRouter()

    @routes.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        body = await ctx.parse(request, schemas.CreateSamplingSession)
        who = tenant(request)
        await ctx.active_session(body.session_id, who)
        if body.model_path is None and body.base_model is None:
            raise ApiError(400, "create_sampling_session needs model_path or base_model")
        base = models.find(body.base_model)
        location = None
        if body.model_path is not None:
            location = await io(checkpoint_location, body.model_path, "sampler_weights", who, "model_path")
            base = models.matching(body.base_model, await io(checkpoint_base, body.model_path, "model_path"),
                                   f"model_path {body.model_path!r}")
        sid = paths.sampling_session_id_of(body.session_id, body.sampling_session_seq_id)
        await io(store.add_sampling_session, sid, body.session_id, base.model_name, body.model_path, location)
        return {"sampling_session_id": sid, "type": "create_sampling_session"}

    @routes.get("/api/v1/samplers/{sampling_session_id}")
    async def get_sampler(sampling_session_id: str, request: Request):
        row = owned(await io(store.sampling_session, sampling_session_id), tenant(request),
                    f"sampler {sampling_session_id!r}")
        return {"sampler_id": sampling_session_id, "base_model": row["base_model"], "model_path": row["model_path"]}

    @routes.post("/api/v1/asample")
    async def asample(request: Request):
        body = await ctx.parse(request, schemas.Sample)
        who = tenant(request)
        session_id = None  # the caller's session the request belongs to (its trace and stats)
        if body.sampling_session_id is not None:
            row = owned(await io(store.sampling_session, body.sampling_session_id), who,
                        f"sampling_session_id {body.sampling_session_id!r}")
            location, session_id = row["location"] or "", row["session_id"]
            base = models.trained_on(row["base_model"], f"sampling session {body.sampling_session_id}")
            if row["model_path"] is not None:  # its checkpoint may have been deleted since: refuse, do not serve
                location = await io(checkpoint_location, row["model_path"], "sampler_weights", who,
                                    f"sampling session {body.sampling_session_id}'s model_path")
        elif body.model_path is not None:
            location = await io(checkpoint_location, body.model_path, "sampler_weights", who, "model_path")
            base = models.matching(body.base_model, await io(checkpoint_base, body.model_path, "model_path"),
                                   f"model_path {body.model_path!r}")
        else:
            base = models.find(body.base_model)
            location = ""
        if body.num_samples > base.max_num_samples:
            raise ApiError(400, f"num_samples {body.num_samples} exceeds this server's limit {base.max_num_samples}")
        prompt: list[int] = []
        for i, chunk in enumerate(body.prompt.chunks):
            if chunk.type != "encoded_text" or chunk.tokens is None:
                raise ApiError(400, f"prompt.chunks[{i}]: {chunk.type} chunks are not supported (text models only)")
            prompt += chunk.tokens
        options = sample_options(body, len(prompt), base)
        p = body.sampling_params
        stop = [p.stop] if isinstance(p.stop, str) else p.stop
        params = types.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
                                      top_p=p.top_p, seed=p.seed, stop=stop)
        sample = SampleRequest(prompt, params, body.num_samples, body.prompt_logprobs, body.topk_prompt_logprobs,
                               location, options, base_model=base.model_name)
        key = None
        if body.sampling_session_id is not None and body.seq_id is not None:
            key = f"sample:{body.sampling_session_id}:{body.seq_id}"
            if (known := await io(store.future_by_key, key)) is not None:  # a resend: same future, no 429
                return {"request_id": known, "sample_sequence_ids": sequence_ids(known, body.num_samples)}
        queued = await io(engine.queued_samples)
        if queued and queued + body.num_samples > engine.config.max_queued_samples:
            raise ApiError(429, f"{queued} sequences are queued (limit {engine.config.max_queued_samples}); retry later")
        request_id = await io(engine.submit, "sample", sample, key, None, None, session_id, body.num_samples,
                              owner=who.id)
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids(request_id, body.num_samples)}

    return routes


def sequence_ids(request_id: str, num_samples: int) -> list[str]:
    """SampledSequence.sequence_id of each sample of a request, in response order."""
    return [f"{request_id}:{i}" for i in range(num_samples)]
