"""JSON request bodies of the Tinker API (SDK 0.38), validated. Unknown fields are ignored (newer SDKs
add some); missing or mistyped ones are 400 errors naming the field."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tx.engine.ops import UserError

MAX_TTL_SECONDS = 10 * 365 * 24 * 3600  # ten years: far beyond any use, far below float/datetime overflow
INT64_MAX = 2**63 - 1  # ids and seq_ids are stored as 64-bit integers
SeqId = Annotated[int, Field(ge=1, le=INT64_MAX)]
Index = Annotated[int, Field(ge=0, le=INT64_MAX)]
# A sequenced request's ttl is checked when its seq_id is known (check_ttl), so that a bad value is
# refused in the model's order; parsing only takes any JSON number.
LooseTtl = int | float | None


def check_ttl(ttl: LooseTtl, field: str = "ttl_seconds") -> int | None:
    """ttl_seconds as a whole number of seconds in [1, MAX_TTL_SECONDS] (or None: never expires)."""
    if ttl is None:
        return None
    whole = isinstance(ttl, int) or (math.isfinite(ttl) and ttl == int(ttl))
    if isinstance(ttl, bool) or not whole or not 1 <= ttl <= MAX_TTL_SECONDS:
        big = isinstance(ttl, int) and abs(ttl) >= 10**24  # str() of a huge int is slow or refused
        shown = f"(an integer of {ttl.bit_length()} bits)" if big else repr(ttl)
        raise UserError(f"{field} {shown} must be a whole number of seconds in [1, {MAX_TTL_SECONDS}] (ten years)")
    return int(ttl)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CreateSession(_Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] = {}
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class SessionRef(_Body):
    session_id: str


class FinishSession(_Body):
    reason: dict[str, Any] | None = None
    detail: str | None = None


class LoraConfigBody(_Body):
    rank: int = Field(32, ge=0)  # 0 = full training, served by --training-mode full
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(_Body):
    type: str = "adamw"


class CreateModel(_Body):
    session_id: str
    model_seq_id: Index
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody = LoraConfigBody()
    optimizer_config: OptimizerConfig = OptimizerConfig()


class ModelRef(_Body):
    model_id: str


class AdamParamsBody(_Body):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(_Body):
    model_id: str
    seq_id: SeqId
    adam_params: AdamParamsBody | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeights(_Body):
    model_id: str
    seq_id: SeqId
    path: str
    ttl_seconds: LooseTtl = None
    overwrite: bool = False
    user_metadata: dict[str, Any] | None = None


class SaveWeightsForSampler(_Body):
    model_id: str
    seq_id: SeqId
    path: str | None = None
    sampling_session_seq_id: Index | None = None
    ttl_seconds: LooseTtl = None
    user_metadata: dict[str, Any] | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"


class LoadWeights(_Body):
    path: str
    optimizer: bool = False
    model_id: str | None = None  # legacy in-place load: with seq_id
    seq_id: SeqId | None = None
    session_id: str | None = None  # create-via-load: with model_seq_id
    model_seq_id: Index | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None


class CreateSamplingSession(_Body):
    session_id: str
    sampling_session_seq_id: Index
    model_path: str | None = None
    base_model: str | None = None


class SamplingParamsBody(_Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class Chunk(_Body):
    type: str = "encoded_text"
    tokens: list[int] | None = None


class ModelInput(_Body):
    chunks: list[Chunk]


class TensorBody(_Body):
    """The SDK's JSON TensorData (types/_pydantic_types/tensor_data.py): flat data, optional CSR indices."""

    data: list[int] | list[float]
    dtype: str
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class Sample(_Body):
    num_samples: int = Field(1, ge=1)
    prompt: ModelInput
    sampling_params: SamplingParamsBody = SamplingParamsBody()
    sampling_session_id: str | None = None
    seq_id: Index | None = None
    base_model: str | None = None
    model_path: str | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(0, ge=0)
    topk_sample_logprobs: int = Field(0, ge=0)
    prompt_alt_tokens_k: int = Field(0, ge=0)
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: TensorBody | None = None


class RetrieveFuture(_Body):
    request_id: str
    allow_metadata_only: bool = False


class CheckpointTtl(_Body):
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL_SECONDS)


class WeightsInfo(_Body):
    tinker_path: str


class SaveWeightsExternal(_Body):
    model_id: str
    seq_id: SeqId
    path: str
    ttl_seconds: LooseTtl = None
    age_encryption_recipients: list[Any] | None = None  # each checked (and named) when the request is built


class CopyWeights(_Body):
    source_path: str
    session_id: str | None = None
    model_seq_id: Index | None = None
    destination_project_id: str | None = Field(None, max_length=256)
    ttl_seconds: LooseTtl = None
    weights_access_token: str | None = None
