"""LoraSlotsState: the LoRA training state of a backend (`training_mode="lora"`).

Many adapters live in the slots of one model: a slot table (slot 0 is the base model), per-slot gradient sums
(`[..., slots, ...]`, like the LoRA factors), AdamW state per adapter (shaped like one slot, so memory is
O(adapters) and weight decay sees one adapter only), and the sampler snapshots and checkpoints of one slot
(`CheckpointMixin`, tx/backends/checkpointing.py). The backend (tx/backends/jax.py) runs the model pass and
calls this for everything that depends on what is trained.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tx import types
from tx.backends.checkpointing import CheckpointMixin
from tx.backends.config import JaxBackendConfig
from tx.backends.slots import SlotTable
from tx.backends.state import StateHost
from tx.backends.steps import commit_grads, init_opt_state, make_optim_step, split_model, zero_slot
from tx.models.adapters import clear_adapter, init_adapter
from tx.models.config import LoraSlots
from tx.models.sharding import put_global, to_host

logger = logging.getLogger(__name__)


class LoraSlotsState(CheckpointMixin):
    training_mode = "lora"
    grad_dtype = None  # a call's gradients keep the LoRA factors' dtype

    @staticmethod
    def configure(config: JaxBackendConfig) -> JaxBackendConfig:
        return config

    @staticmethod
    def model_options(config: JaxBackendConfig) -> dict[str, Any]:
        """The base model with `max_lora_adapters` slots of rank `max_lora_rank`, in the config's dtype, expert
        kernels whole (only the LoRA factors train)."""
        return {"slots": LoraSlots(max_lora_adapters=config.max_lora_adapters, max_lora_rank=config.max_lora_rank),
                "dtype": config.dtype, "experts_whole": True}

    def __init__(self, host: StateHost):
        self.host = host
        self.slots = SlotTable(host.config.max_lora_adapters)
        self.opt_states: dict[str, Any] = {}
        _, lora, _ = split_model(host.model)
        self.grad_sum = jax.tree.map(jnp.zeros_like, lora)
        self.init_snapshots()

    def split_trainable(self, model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
        """(graphdef, what forward_backward differentiates, everything else): here the LoRA factors."""
        return split_model(model)

    def slot(self, model_id: str) -> int:
        if model_id not in self.host.models:
            raise KeyError(f"unknown model_id {model_id!r}")
        return self.host.models[model_id].adapter_index

    def sample_slot(self, model_id: str) -> int:
        return self.slot(model_id) if model_id else 0

    # ---- adapters ----

    def create(self, model_id: str, lora_config: types.LoraConfig) -> types.ModelMetadata:
        config = self.host.config
        if lora_config.rank == 0:
            raise ValueError("LoRA rank 0 means full training, which this backend (training_mode='lora') does not "
                             "do: use training_mode='full' (python -m tx.run --training-mode full)")
        if not 1 <= lora_config.rank <= config.max_lora_rank:
            raise ValueError(f"LoRA rank {lora_config.rank} must be in [1, max_lora_rank={config.max_lora_rank}]")
        slot = self.slots.take()
        if slot is None:
            raise ValueError(
                f"no free adapter slot: all {config.max_lora_adapters - 1} slots are in use "
                f"(max_lora_adapters={config.max_lora_adapters}, slot 0 is the base model)"
            )
        self.slot_changed(slot)
        # An unseeded adapter gets a seed derived from its id: reproducible, and equal on every host.
        seed = lora_config.seed if lora_config.seed is not None else zlib.crc32(model_id.encode())
        try:
            init_adapter(
                self.host.model, slot, rank=lora_config.rank, alpha=lora_config.alpha, seed=seed,
                train_attn=lora_config.train_attn, train_mlp=lora_config.train_mlp,
                train_unembed=lora_config.train_unembed,
            )
            _, lora, _ = split_model(self.host.model)
            self.opt_states[model_id] = init_opt_state(lora, slot, self.host.mesh)
        except BaseException:  # the slot must not leak (nor keep half an adapter)
            self.opt_states.pop(model_id, None)
            clear_adapter(self.host.model, slot)
            self.slots.release(slot)
            raise
        logger.info("created model %s in slot %d (rank %d)", model_id, slot, lora_config.rank)
        return types.ModelMetadata(model_id=model_id, adapter_index=slot,
                                   lora_config=lora_config.model_copy(update={"seed": seed}))

    def delete(self, model_id: str) -> None:
        slot = self.slot(model_id)
        self.before_slot_change(model_id, unloading=True)
        clear_adapter(self.host.model, slot)
        self.reset_grads(model_id)
        del self.opt_states[model_id]
        self.slots.release(slot)
        logger.info("deleted model %s, freed slot %d", model_id, slot)

    # ---- gradients ----

    def reset_grads(self, model_id: str) -> None:
        """Zero the gradient sums of the model's slot (in place: the old sums are donated)."""
        self.grad_sum = zero_slot(self.grad_sum, jnp.int32(self.slot(model_id)))

    def commit(self, acc: Any, allowed: set[int]) -> set[int]:
        """Add a call's gradients `acc` into the sums of the `allowed` slots whose new sums are finite; those
        slots (the others keep their sums bit for bit)."""
        allowed_s = np.zeros(self.host.config.max_lora_adapters, bool)
        allowed_s[sorted(allowed)] = True
        allowed_s = put_global(allowed_s, NamedSharding(self.host.mesh, P()))  # the same value on every host
        self.grad_sum, finite_s = commit_grads(self.grad_sum, acc, allowed_s)
        return {int(s) for s in np.flatnonzero(to_host(finite_s))} & allowed

    def grad_sum_of(self, model_id: str) -> dict:
        """The adapter's accumulated gradient sums, `{"dotted.path": array}` of its slot (for inspection)."""
        slot = self.slot(model_id)
        flat = nnx.to_flat_state(self.grad_sum)
        return {".".join(map(str, path)): to_host(jnp.take(v.get_value(), slot, axis=-3)) for path, v in flat}

    def grad_sum_bytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.grad_sum))

    def opt_state_of(self, model_id: str) -> Any:
        self.slot(model_id)
        return self.opt_states[model_id]

    # ---- optimizer ----

    def optim_step(self, model_id: str, hp: dict[str, jax.Array]) -> tuple[dict, jax.Array]:
        """AdamW on the model's slot; (metrics, ok), the state unchanged unless ok."""
        slot = self.slot(model_id)
        self.before_slot_change(model_id)  # snapshots served from this slot keep the weights they saved
        runtime = self.host.runtime
        fn = runtime.program(("optim_step",), lambda: make_optim_step(runtime.counted("optim_step")))
        _, lora, _ = split_model(self.host.model)
        lora, self.grad_sum, self.opt_states[model_id], metrics, ok = runtime.run(
            "optim_step", fn, lora, self.grad_sum, self.opt_states[model_id], jnp.int32(slot), hp)
        nnx.update(self.host.model, lora)
        return metrics, ok
