"""The training-state strategy of a backend, as Protocols: what the one backend class (tx/backends/jax.py)
calls on its state (`TrainingState`: LoRA slots in lora_state.py, full weights in full_state.py), and what a
state reads from the backend that holds it (`StateHost`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jax
from flax import nnx

from tx import types
from tx.backends.config import JaxBackendConfig
from tx.backends.slots import SlotTable
from tx.runtime import Runtime


class StateHost(Protocol):
    """The backend as its training state sees it (public members only)."""

    config: JaxBackendConfig
    mesh: Any
    model: nnx.Module
    model_dir: Path
    base_model: str
    models: dict[str, types.ModelMetadata]
    metrics: types.EngineMetrics
    runtime: Runtime
    sampler: Any  # tx.sampling.sampler.Sampler: `before_weights_change(slot)` before weights a row reads change

    def load_base(self, dtype: str | None = None) -> nnx.Module:
        """The base model from its checkpoint, loaded as the state's `model_options` say (dtype overridden)."""

    def unique_name(self) -> str: ...


@runtime_checkable
class TrainingState(Protocol):
    """What is trained and how: the gradient sums, optimizer state, model create/delete, the commit of a
    call's gradients, optim_step and the checkpoints. Every method that takes a model id raises KeyError for
    one the backend does not hold."""

    training_mode: str  # the config's training_mode this state serves
    grad_dtype: Any  # dtype of a call's gradients (None: the trained weights')
    slots: SlotTable  # adapter slots; sampler checkpoints are lent free ones

    @staticmethod
    def configure(config: JaxBackendConfig) -> JaxBackendConfig:
        """The config the backend runs (what it sets is logged once where the user gave another value)."""

    @staticmethod
    def model_options(config: JaxBackendConfig) -> dict[str, Any]:
        """`load_model` arguments for the base model: LoRA slots, dtype, expert layout."""

    def split_trainable(self, model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
        """(graphdef, what forward_backward differentiates, everything else)."""

    def slot(self, model_id: str) -> int:
        """The adapter slot training rows of `model_id` read."""

    def sample_slot(self, model_id: str) -> int:
        """The slot a sampling (or forward) row of `model_id` reads ("" = the base model)."""

    def kv_identity(self, slot: int, tenant: str = "") -> str | None: ...

    def create(self, model_id: str, lora_config: types.LoraConfig) -> types.ModelMetadata:
        """Set up a new model's weights and optimizer state; its metadata (the backend stores it)."""

    def delete(self, model_id: str) -> None:
        """Free what the model holds (the backend drops its metadata right after)."""

    def reset_grads(self, model_id: str) -> None: ...

    def commit(self, acc: Any, allowed: set[int]) -> set[int]:
        """Add a call's gradients into the sums of the `allowed` slots where the result is finite; the slots
        whose new sums are finite."""

    def optim_step(self, model_id: str, hp: dict[str, jax.Array]) -> tuple[dict, jax.Array]:
        """AdamW from the model's gradient sums; (metrics, ok): nothing changed unless ok."""

    def grad_sum_of(self, model_id: str) -> dict: ...

    def grad_sum_bytes(self) -> int: ...

    def opt_state_of(self, model_id: str) -> Any: ...

    def save_checkpoint(self, output_path, model_id: str) -> None: ...

    def checkpoint_metadata(self, checkpoint_path) -> dict: ...

    def load_checkpoint(self, checkpoint_path, model_id: str, load_optimizer: bool = True) -> dict:
        """Restore weights (and optimizer state); the model's new metadata fields (lora_config, optim_steps).
        The backend then resets the model's gradient sums and counters."""

    def save_sampler_checkpoint(self, output_path, model_id: str, persist: bool = True) -> None: ...

    def evict_sampler_checkpoint(self, path) -> None: ...

    def sampler_slot(self, path: str, pinned: set[int]) -> int: ...

    def holds_snapshot(self, path: str) -> bool: ...

    def save_external_weights(self, output_path, model_id: str, age_recipients: list[str] | None = None) -> None:
        ...
