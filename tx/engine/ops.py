"""What the engine executes: one `Op` per accepted request, already decoded and validated for shape by
the API layer, so the engine never sees wire formats."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tx import types

# Training ops sequenced per model by seq_id. A model's create (or create-from-state) is its seq 0.
PASS_KINDS = ("forward_backward", "forward")
MODEL_KINDS = ("create_model", "create_from_state", *PASS_KINDS, "optim_step", "save_weights",
               "save_weights_for_sampler", "save_weights_external", "load_weights")


class UserError(ValueError):
    """A request that cannot run as asked: reported to that request's future with category 'user'."""


class RequestTooLarge(UserError):
    """A request over a size limit (the API answers 413)."""


@dataclass
class Datum:
    input_ids: list[int]
    targets: list[int] | list[list[int]]  # [n], or [n, K] (K targets per position)
    weights: list[float] | list[list[float]]  # same shape as targets, or [] (zeros)
    logprobs: list[float]
    advantages: list[float]
    ratio_mask: list[float] = field(default_factory=list)  # sequence_ratio_mask; [] = zeros
    extra_inputs: dict[str, list[float]] = field(default_factory=dict)  # keys a registered loss declares


@dataclass
class PassRequest:
    datums: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None


@dataclass
class CreateRequest:
    lora_config: types.LoraConfig
    base_model: str | None = None  # the served base model's name; None = the server's default


@dataclass
class CreateFromStateRequest:
    location: str  # the training checkpoint to restore
    optimizer: bool
    base_model: str | None = None  # the base model it was trained on; None = the server's default


@dataclass
class SaveRequest:
    name: str | None  # None: an in-memory snapshot for a new sampling session
    ttl_seconds: int | None = None
    user_metadata: dict[str, Any] = field(default_factory=dict)
    sampling_session_id: str | None = None
    age_recipients: list[str] = field(default_factory=list)  # save_weights_external: encrypt to these


@dataclass
class LoadRequest:
    location: str
    optimizer: bool


@dataclass
class SampleRequest:
    prompt: list[int]
    params: types.SamplingParams
    num_samples: int
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    location: str  # sampler checkpoint to sample from; "" = the base model
    options: types.SampleOptions = field(default_factory=types.SampleOptions)  # SDK >= 0.32 fields
    base_model: str | None = None  # which served base model; None = the server's default


@dataclass
class Op:
    request_id: str
    kind: str
    payload: Any
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    size: int = 1  # datums (passes) or sequences (samples): what round limits count
    tokens: int = 0  # input tokens of a pass: counted against the round's max_pass_tokens
    owner: str | None = None  # the tenant that sent it
