"""Wire and API types of the backend contract (pydantic, validated, `extra="forbid"`).

Names and fields follow the seed contract (AbstractBackend / JaxBackend) and Tinker's semantics.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TensorData(_Strict):
    """A flat tensor with its dtype and shape, as Tinker's `TensorData`."""

    data: list[float] | list[int]
    dtype: Literal["float32", "int64", "int32"]
    shape: list[int] | None = None

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        dtype = {np.dtype(np.float32): "float32", np.dtype(np.int64): "int64", np.dtype(np.int32): "int32"}
        return cls(data=array.reshape(-1).tolist(), dtype=dtype[array.dtype], shape=list(array.shape))

    def to_numpy(self) -> np.ndarray:
        arr = np.asarray(self.data, dtype=self.dtype)
        return arr.reshape(self.shape) if self.shape is not None else arr


class LoraConfig(_Strict):
    """One adapter's LoRA settings. Tinker's SDK sends rank, seed and the three train_* flags."""

    rank: int = Field(32, ge=0, description="LoRA rank r (<= the backend's max_lora_rank); 0 = full training "
                      "(training_mode='full', which ignores the rank)")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: the delta is (alpha / rank) * x A B")
    seed: int | None = Field(None, ge=-(2**63), lt=2**63,
                             description="seed of the A init (a 64-bit integer); None derives one from the model id")
    train_attn: bool = Field(True, description="adapt q/k/v/o projections")
    train_mlp: bool = Field(True, description="adapt MLP (and MoE expert) projections")
    train_unembed: bool = Field(True, description="adapt the LM head")

    @model_validator(mode="after")
    def _one_target(self) -> LoraConfig:
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise ValueError("at least one of train_attn, train_mlp, train_unembed must be true")
        return self


def float32_value(field: str, value: float) -> float:
    """`value` as the device will see it (float32); raises, naming `field`, if it is not finite there
    (e.g. 1e39 is a valid float64 but infinity in float32)."""
    with np.errstate(over="ignore"):
        rounded = float(np.float32(value))
    if not np.isfinite(rounded):
        raise ValueError(f"{field} = {value} is not finite in float32 (|value| must be < 3.4e38)")
    return rounded


class AdamParams(_Strict):
    """AdamW hyperparameters of one optim_step (Tinker's defaults). Ranges hold after rounding to float32,
    the dtype the step runs in."""

    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0, description="decoupled (AdamW), applied to this adapter only")
    grad_clip_norm: float = Field(0.0, ge=0, description="clip the global gradient norm to this; 0 = off")

    @model_validator(mode="after")
    def _float32(self) -> AdamParams:
        for field in type(self).model_fields:
            float32_value(field, getattr(self, field))
        for field in ("beta1", "beta2"):
            if float(np.float32(getattr(self, field))) >= 1.0:
                raise ValueError(f"{field} = {getattr(self, field)} rounds to 1.0 in float32; it must be < 1")
        tiny = float(np.finfo(np.float32).tiny)  # smaller values are denormal (flushed to 0 on accelerators)
        if self.eps < tiny:
            raise ValueError(f"eps = {self.eps} is denormal or 0 in float32; it must be >= {tiny:.4g}")
        return self


class OptimStepInput(_Strict):
    adam_params: AdamParams = AdamParams()


class OptimStepOutput(_Strict):
    metrics: dict[str, float] = {}


class PreparedModelPassBatch(_Strict):
    """All datums of a batch of forward / forward_backward requests, flattened (one entry per datum)."""

    all_input_ids: list[list[int]]
    all_targets: list[list[int] | list[list[int]]] = Field(
        description="per datum: [n] target ids, or [n, K] (K targets per position, for losses that take them)")
    all_token_weights: list[list[float] | list[list[float]]] = Field(
        description="per datum: [n] weights, or [n, K] with 2-D targets (same shape); [] = zeros")
    all_sampling_logprobs: list[list[float]]
    all_advantages: list[list[float]]
    all_model_ids: list[str]
    all_loss_fns: list[str]
    all_loss_fn_configs: list[dict[str, float] | None]
    request_batch_slices: list[tuple[str, str, int, int]] = Field(
        description="(request_id, model_id, start, end): datums [start, end) belong to that request"
    )
    all_ratio_masks: list[list[float]] | None = Field(
        None, description="per datum: sequence_ratio_mask ([n], [] = zeros); gspo's sequence ratio and "
        "stable_reinforce's recorded positions; None = zeros for every datum")
    all_segment_ids: list[list[int]] | None = Field(
        None, description="packed datums: per token, which example it belongs to (attention stays within an "
        "example, positions restart at each); None = one example per datum"
    )
    all_extra_inputs: dict[str, list[list[float]]] | None = Field(
        None, description="extra per-token loss inputs by key (the keys a loss declares with `input_keys`), "
        "one [n] list per datum ([] = zeros); None = none")
    all_temperatures: list[float] | None = Field(
        None, description="per datum: log-probs (and entropy) of softmax(logits / T), as an RL trainer's "
        "`algorithm.temperature`; > 0; None = 1 for every datum (in-process only: not in Tinker's API)")

    @model_validator(mode="after")
    def _same_lengths(self) -> PreparedModelPassBatch:
        n = len(self.all_input_ids)
        fields = ("all_targets", "all_token_weights", "all_sampling_logprobs", "all_advantages",
                  "all_model_ids", "all_loss_fns", "all_loss_fn_configs")
        if self.all_segment_ids is not None:
            fields += ("all_segment_ids",)
        if self.all_ratio_masks is not None:
            fields += ("all_ratio_masks",)
        if self.all_temperatures is not None:
            fields += ("all_temperatures",)
        for name in fields:
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, all_input_ids has {n}")
        for key, values in (self.all_extra_inputs or {}).items():
            if len(values) != n:
                raise ValueError(f"all_extra_inputs[{key!r}] has {len(values)} entries, all_input_ids has {n}")
        for request_id, _, start, end in self.request_batch_slices:
            if not 0 <= start <= end <= n:
                raise ValueError(f"request {request_id}: slice [{start}, {end}) outside the batch of {n} datums")
        return self


class ForwardBackwardOutput(_Strict):
    loss_fn_output_type: str = "ArrayRecord"
    loss_fn_outputs: list[dict[str, TensorData]] = Field(
        description="one dict per datum, in request order: 'logprobs' and 'elementwise_loss'"
    )
    metrics: dict[str, float] = Field(description="Tinker-style 'name:reduction' keys, e.g. 'loss:sum'")


class ErrorResponse(_Strict):
    error: str
    status: str = "failed"


class ModelMetadata(_Strict):
    """What the backend holds for one model (adapter)."""

    model_id: str
    adapter_index: int
    lora_config: LoraConfig
    optim_steps: int = 0


class EngineMetrics(_Strict):
    """Counters of the backend's jit-compiled functions (to check bucketing keeps compiles bounded), and
    of the tokens they ran: `tokens_real` (the datums') vs `tokens_padded` (the device batches')."""

    compiles: dict[str, int] = {}
    calls: dict[str, int] = {}
    tokens_real: dict[str, int] = {}
    tokens_padded: dict[str, int] = {}
    sampling: dict[str, int] = {}  # the paged sampling engine's counters (prefill tokens computed / cached, ...)


# ---- sampling types (filled by the sampling issue) ----


class SamplingParams(_Strict):
    """Tinker's sampling parameters. Values are checked per request by the backend (a bad value fails that
    request only), so the fields carry types, not ranges."""

    max_tokens: int | None = Field(None, description="new tokens at most; None = up to the context limit")
    temperature: float = Field(1.0, description="0 = greedy")
    top_k: int = Field(-1, description="keep the k most likely tokens; -1 or 0 = off")
    top_p: float = Field(1.0, description="nucleus mass in (0, 1]; 1 = off")
    min_p: float = Field(0.0, description="drop tokens less likely than min_p * the most likely one's probability "
                         "(after temperature), in [0, 1]; 0 = off. Not in Tinker's SDK: in-process API only")
    repetition_penalty: float = Field(
        1.0, description="> 0; tokens of the prompt or generated so far get logit / r (logit > 0) or logit * r; "
        "1 = off. Changes the choice only, not the returned log-probs. Not in Tinker's SDK: in-process API only")
    seed: int | None = Field(None, description="sample i of a request uses seed + i; None derives one from the request id")
    stop: list[int] | list[str] | None = Field(
        None, description="stop token ids or stop strings; None = the model's EOS; [] = never stop early"
    )


class TargetPromptIds(_Strict):
    """A request's `target_prompt_logprobs` (SDK >= 0.32): int64 token ids of shape [len(prompt) - 1, K], cell
    [i, j] scored at prompt position i + 1; -1 asks for nothing. Dense (`ids` row-major, rows * K values) or
    sparse CSR (`ids` = the listed values, with `crow` [rows + 1] and `col` [len(ids)]), as the SDK's
    TensorData. Layout checks: tx.sampling.targets."""

    shape: tuple[int, int]
    ids: list[int]
    crow: list[int] | None = None
    col: list[int] | None = None


class TargetPromptLogprobs(_Strict):
    """The answer to TargetPromptIds: float32 log-probs in the request's shape and layout (the same `crow` /
    `col` when sparse), 0.0 where the request had -1 (SDK 0.38 SampleResponse.target_prompt_logprobs)."""

    shape: tuple[int, int]
    logprobs: list[float]
    crow: list[int] | None = None
    col: list[int] | None = None


class SampleOptions(_Strict):
    """Per-request fields of SDK >= 0.32 (tinker 0.38 types/sample_request.py); defaults = not asked."""

    topk_sample_logprobs: int = Field(0, description="top-k (id, log-prob) pairs at every generated token")
    prompt_alt_tokens_k: int = Field(0, description="draws at the request's temperature at every prompt position > 0")
    prompt_logprobs_last_n: int | None = Field(None, description="score only the last N prompt tokens "
                                               "(prompt_logprobs and topk_prompt_logprobs)")
    target_prompt_logprobs: TargetPromptIds | None = None


class PreparedSampleBatch(_Strict):
    all_prompts: list[list[int]]
    all_sampling_params: list[SamplingParams]
    all_model_ids: list[str]
    all_checkpoint_ids: list[str]
    all_checkpoint_paths: list[str]
    request_batch_slices: list[tuple[str, str, int, int, bool, int]] = Field(
        description="(request_id, model_id, start, end, prompt_logprobs, topk_prompt_logprobs)"
    )
    request_options: list[SampleOptions] = Field(
        default_factory=list, description="per request, aligned with request_batch_slices ([] = all defaults)"
    )
    request_tenants: list[str] = Field(
        default_factory=list, description="per request, who sent it (aligned with request_batch_slices): the "
        "prefix-cache partition of its rows, and the unit of the paged engine's fair admission. [] or '': rows on "
        "weights tenants share (the base model, sampler checkpoints) never reuse KV pages of other requests"
    )


class GeneratedSequence(_Strict):
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    topk_logprobs: list[list[tuple[int, float]]] | None = Field(
        None, description="topk_sample_logprobs: per generated token, the k most likely (id, log-prob) pairs"
    )


class SampleOutput(_Strict):
    sequences: list[GeneratedSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    target_prompt_logprobs: TargetPromptLogprobs | None = None
    prompt_alt_tokens: list[list[tuple[int, float]]] | None = Field(
        None, description="prompt_alt_tokens_k: per prompt position 1..n-1, k (id, log-prob) draws"
    )
    prompt_cache_hit_tokens: int = Field(0, description="prompt tokens whose keys/values came from the prefix cache")
