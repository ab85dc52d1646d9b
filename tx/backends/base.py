"""The backend contract (from the seed): what an engine calls to train and sample many adapters."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pydantic import BaseModel

from tx import types


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

