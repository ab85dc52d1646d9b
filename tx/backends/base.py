"""The backend contract: the seed's `AbstractBackend`, and the Protocols `Backend` / `LocalBackend` that state
what tx's engine, distributed wrapper, worker, API and tools really call on a backend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel

from tx import types
from tx.sampling.source import WeightsSource


class AbstractBackend(ABC):
    """Backends own the model, adapter slots and optimizer state; the engine owns requests and storage."""

    @abstractmethod
    def __init__(self, base_model: str, config: BaseModel):
        """Load `base_model` (a local HF directory or hub id) and set up devices per `config`."""

    @abstractmethod
    def create_model(self, model_id: str, lora_config: types.LoraConfig) -> None:
        """Give `model_id` a free adapter slot, initialise its LoRA weights and optimizer state."""

    @abstractmethod
    def forward_backward(
        self, prepared_batch: types.PreparedModelPassBatch
    ) -> dict[str, types.ForwardBackwardOutput | types.ErrorResponse]:
        """Forward and backward over the batch; gradients accumulate per adapter. Keyed by request id."""

    @abstractmethod
    def forward(
        self, prepared_batch: types.PreparedModelPassBatch
    ) -> dict[str, types.ForwardBackwardOutput | types.ErrorResponse]:
        """Forward only: log-probs and losses, no gradient. Keyed by request id."""

    @abstractmethod
    def optim_step(self, model_id: str, request_data: types.OptimStepInput) -> types.OptimStepOutput:
        """Apply the adapter's accumulated gradients with AdamW, then reset them."""

    @abstractmethod
    def sample(
        self, prepared_batch: types.PreparedSampleBatch
    ) -> dict[str, types.SampleOutput | types.ErrorResponse]:
        """Generate completions for a batch of sampling requests. Keyed by request id."""

    @abstractmethod
    def save_checkpoint(self, output_path, model_id: str) -> None:
        """Save the adapter's training state (weights and optimizer) to `output_path`."""

    @abstractmethod
    def load_checkpoint(self, checkpoint_path, model_id: str) -> None:
        """Restore the adapter's training state from `checkpoint_path`."""

    @abstractmethod
    def save_sampler_checkpoint(self, output_path, model_id: str, persist: bool = True) -> None:
        """Make the adapter's current weights available for sampling; write them to disk if `persist`."""

    @abstractmethod
    def has_model(self, model_id: str) -> bool:
        """Whether `model_id` holds an adapter slot."""

    @abstractmethod
    def delete_model(self, model_id: str) -> None:
        """Free the adapter slot of `model_id` and everything attached to it."""

    # Requests in flight. These defaults run a submitted batch whole with `sample` at the next step; a
    # backend with continuous batching (JaxBackend's paged engine) advances them one iteration per step.

    def sample_submit(self, prepared_batch: types.PreparedSampleBatch) -> dict[str, types.ErrorResponse]:
        """Queue sampling requests; those refused at once, with their errors (the others end in `sample_step`)."""
        self.__dict__.setdefault("_queued_sample_batches", []).append(prepared_batch)
        return {}

    def sample_step(self) -> dict[str, types.SampleOutput | types.ErrorResponse]:
        """Advance queued sampling requests; those that ended (the others stay queued)."""
        batches, self.__dict__["_queued_sample_batches"] = self.__dict__.get("_queued_sample_batches", []), []
        out: dict[str, types.SampleOutput | types.ErrorResponse] = {}
        for batch in batches:
            out |= self.sample(batch)
        return out

    @property
    def sampling_active(self) -> bool:
        return bool(self.__dict__.get("_queued_sample_batches"))



# ---- the contract as called ----
#
# `AbstractBackend` above is the seed's contract. What tx's own callers really call on a backend is stated
# below as two Protocols; tests/backends/test_contract.py checks that both training modes satisfy them and
# that the engine, the distributed wrapper, the worker, precompile, run and the API call nothing else.


@runtime_checkable
class Backend(Protocol):
    """What the engine (tx/engine) calls on a backend, and what `tx.distributed.backend.DistributedBackend`
    broadcasts to (or reads from) each host's local backend; the DistributedBackend satisfies it too."""

    @property
    def models(self) -> dict[str, types.ModelMetadata]:
        """The models this backend holds, by id."""

    @property
    def metrics(self) -> types.EngineMetrics:
        """Compile, call and token counters of the backend's programs."""

    @property
    def sampling_active(self) -> bool:
        """Whether sampling requests are in flight (`sample_step` has work)."""

    def has_model(self, model_id: str) -> bool: ...

    def create_model(self, model_id: str, lora_config: types.LoraConfig) -> None: ...

    def delete_model(self, model_id: str) -> None: ...

    def forward(self, prepared_batch: types.PreparedModelPassBatch) -> dict: ...

    def forward_backward(self, prepared_batch: types.PreparedModelPassBatch) -> dict: ...

    def forward_backward_planned(self, prepared_batch: types.PreparedModelPassBatch, plan: list[list[int]]) -> dict:
        """forward_backward with the micro-batches given (precompile runs each program's shapes this way)."""

    def optim_step(self, model_id: str, request_data: types.OptimStepInput) -> types.OptimStepOutput: ...

    def sample(self, prepared_batch: types.PreparedSampleBatch) -> dict: ...

    def sample_submit(self, prepared_batch: types.PreparedSampleBatch) -> dict[str, types.ErrorResponse]: ...

    def sample_step(self) -> dict: ...

    def save_checkpoint(self, output_path, model_id: str) -> None: ...

    def checkpoint_metadata(self, checkpoint_path) -> dict:
        """A training checkpoint's metadata (its LoraConfig lets an engine recreate the model first)."""

    def load_checkpoint(self, checkpoint_path, model_id: str, load_optimizer: bool = True) -> None: ...

    def save_sampler_checkpoint(self, output_path, model_id: str, persist: bool = True) -> None: ...

    def evict_sampler_checkpoint(self, path) -> None:
        """Forget sampler checkpoint `path` (its files were deleted)."""

    def save_external_weights(self, output_path, model_id: str, age_recipients: list[str] | None = None) -> None: ...

    def debug_fail(self, message: str, process_ids: list[int], phase: str = "execute") -> None:
        """Fault injection for multi-host tests."""


@runtime_checkable
class LocalBackend(Backend, WeightsSource, Protocol):
    """The backend of this process (`DistributedBackend.impl`, a worker's backend): `Backend`, the sampler's
    `WeightsSource`, and what the API, run, precompile, the memory report and the pre-call checks read."""

    training_mode: str  # "lora" | "full": the config's training_mode this backend serves
    config: Any  # its JaxBackendConfig
    mesh: Any  # its (fsdp, ep, tp) jax Mesh
    slots: Any  # its SlotTable (checks.py: which sampler checkpoints a slot holds)

    def holds_snapshot(self, path: str) -> bool:
        """Whether sampler checkpoint `path` is held in memory (sampled without reading the disk)."""

    def grad_sum_bytes(self) -> int:
        """Bytes of the gradient sums this backend holds (global sizes)."""
