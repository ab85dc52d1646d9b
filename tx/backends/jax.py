"""JaxBackend: one process's implementation of the backend contract over a (fsdp, ep, tp) mesh.

Many adapters live in the slots of one model; forward_backward runs rows of several adapters in one
jit-compiled call and accumulates gradient sums per slot; optim_step applies AdamW to one slot with that
adapter's own optimizer state. The multi-host wrapper (distributed issue) broadcasts these calls.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from tx import losses, types
from tx.backends import batching
from tx.backends.base import AbstractBackend
from tx.backends.checkpointing import CheckpointMixin
from tx.backends.config import JaxBackendConfig
from tx.backends.sampler import Sampler
from tx.backends.slots import SlotTable
from tx.backends.steps import init_opt_state, make_model_pass, make_optim_step, split_model
from tx.models.adapters import clear_adapter, init_adapter
from tx.models.config import LoraSlots
from tx.models.loading import load_model, resolve_model_dir
from tx.models.sharding import batch_spec, make_mesh, put_global, to_host

logger = logging.getLogger(__name__)


class JaxBackend(CheckpointMixin, AbstractBackend):
    def __init__(self, base_model: str, config: JaxBackendConfig | None = None, run_id: str | None = None):
        self.base_model = base_model
        # Names this backend creates (checkpoint versions) are run_id + a counter: equal on every host
        # when the coordinator hands all hosts the same run_id.
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self._names = 0
        self.config = config = config or JaxBackendConfig()
        fsdp = config.fully_sharded_data_parallel_size
        n = fsdp * config.expert_parallel_size * config.tensor_parallel_size
        if n > len(jax.devices()):
            raise ValueError(f"mesh fsdp*ep*tp = {n} needs {n} devices; {len(jax.devices())} available")
        if jax.process_count() > 1 and n != jax.device_count():
            raise ValueError(f"a multi-host mesh must cover all {jax.device_count()} devices of the "
                             f"{jax.process_count()} processes; fsdp*ep*tp = {n}")
        if config.train_micro_batch_size % fsdp:
            raise ValueError(
                f"train_micro_batch_size={config.train_micro_batch_size} must be a multiple of "
                f"fully_sharded_data_parallel_size={fsdp}"
            )
        self.mesh = make_mesh(fsdp, config.expert_parallel_size, config.tensor_parallel_size, jax.devices()[:n])
        self.model_dir = resolve_model_dir(base_model)
        self.model = load_model(
            self.model_dir,
            LoraSlots(max_lora_adapters=config.max_lora_adapters, max_lora_rank=config.max_lora_rank),
            self.mesh,
            dtype=config.dtype,
            gradient_checkpointing=config.gradient_checkpointing,
            shard_attention_heads=config.shard_attention_heads,
        )
        self.max_seq_len = config.max_seq_len or self.model.config.max_position_embeddings
        self.models: dict[str, types.ModelMetadata] = {}
        self._opt_states: dict[str, Any] = {}
        self._accumulated: dict[str, dict[str, float]] = {}
        self.slots = SlotTable(config.max_lora_adapters)
        self._init_snapshots()
        _, lora, _ = split_model(self.model)
        self._grad_sum = jax.tree.map(jnp.zeros_like, lora)
        self.metrics = types.EngineMetrics()
        self._fns: dict[Any, Callable] = {}
        self._sampler = Sampler(self, self.model_dir)

    # ---- bookkeeping ----

    def _counted(self, name: str) -> Callable[[], None]:
        def on_trace():
            self.metrics.compiles[name] = self.metrics.compiles.get(name, 0) + 1

        return on_trace

    def _fn(self, key: tuple, build: Callable[[], Callable]) -> Callable:
        if key not in self._fns:
            self._fns[key] = build()
        return self._fns[key]

    def _run(self, name: str, fn: Callable, *args, **kwargs):
        self.metrics.calls[name] = self.metrics.calls.get(name, 0) + 1
        ctx = jax.disable_jit() if self.config.enforce_eager else contextlib.nullcontext()
        with ctx:
            return fn(*args, **kwargs)

    def _slot(self, model_id: str) -> int:
        if model_id not in self.models:
            raise KeyError(f"unknown model_id {model_id!r}")
        return self.models[model_id].adapter_index

    def debug_fail(self, message: str, process_ids: list[int], phase: str = "execute") -> None:
        """Fault injection for multi-host tests: raise `message` on the listed processes."""
        if phase == "execute" and jax.process_index() in process_ids:
            raise RuntimeError(message)

    def unique_name(self) -> str:
        self._names += 1
        return f"{self.run_id}-{self._names:06d}"

    def _reset_accumulation(self, model_id: str, slot: int | None = None) -> None:
        """Forget what the adapter accumulated since its last step: counters, and gradient sums of `slot`."""
        if slot is not None:
            self._grad_sum = jax.tree.map(lambda g: g.at[..., slot, :, :].set(0), self._grad_sum)
        self._accumulated[model_id] = {"sequences": 0, "tokens": 0}

    def has_model(self, model_id: str) -> bool:
        return model_id in self.models

    # ---- adapters ----

    def create_model(self, model_id: str, lora_config: types.LoraConfig) -> None:
        if model_id in self.models:
            raise ValueError(f"model_id {model_id!r} already exists")
        if not 1 <= lora_config.rank <= self.config.max_lora_rank:
            raise ValueError(f"LoRA rank {lora_config.rank} must be in [1, max_lora_rank={self.config.max_lora_rank}]")
        slot = self.slots.take()
        if slot is None:
            raise ValueError(
                f"no free adapter slot: all {self.config.max_lora_adapters - 1} slots are in use "
                f"(max_lora_adapters={self.config.max_lora_adapters}, slot 0 is the base model)"
            )
        # An unseeded adapter gets a seed derived from its id: reproducible, and equal on every host.
        seed = lora_config.seed if lora_config.seed is not None else zlib.crc32(model_id.encode())
        init_adapter(
            self.model, slot, rank=lora_config.rank, alpha=lora_config.alpha, seed=seed,
            train_attn=lora_config.train_attn, train_mlp=lora_config.train_mlp, train_unembed=lora_config.train_unembed,
        )
        _, lora, _ = split_model(self.model)
        self._opt_states[model_id] = init_opt_state(lora, slot, self.mesh)
        self._reset_accumulation(model_id)
        self.models[model_id] = types.ModelMetadata(
            model_id=model_id, adapter_index=slot, lora_config=lora_config.model_copy(update={"seed": seed})
        )
        logger.info("created model %s in slot %d (rank %d)", model_id, slot, lora_config.rank)

    def delete_model(self, model_id: str) -> None:
        slot = self._slot(model_id)
        self._before_slot_change(model_id, unloading=True)
        clear_adapter(self.model, slot)
        self._reset_accumulation(model_id, slot)
        del self.models[model_id], self._opt_states[model_id], self._accumulated[model_id]
        self.slots.release(slot)
        logger.info("deleted model %s, freed slot %d", model_id, slot)

    def grad_sum_of(self, model_id: str) -> dict:
        """The adapter's accumulated gradient sums, `{"dotted.path": array}` of its slot (for inspection)."""
        slot = self._slot(model_id)
        flat = nnx.to_flat_state(self._grad_sum)
        return {".".join(map(str, path)): to_host(jnp.take(v.get_value(), slot, axis=-3)) for path, v in flat}

    def opt_state_of(self, model_id: str) -> Any:
        self._slot(model_id)
        return self._opt_states[model_id]

    # ---- forward / backward ----

    def forward_backward(self, prepared_batch: types.PreparedModelPassBatch):
        return self._model_pass(prepared_batch, with_grad=True)

    def forward(self, prepared_batch: types.PreparedModelPassBatch):
        return self._model_pass(prepared_batch, with_grad=False)

    def _micro_batches(self, rows: list[batching.Row]) -> list[list[int]]:
        """Row indices per jit call: longest first, so rows of similar length share a padded shape."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i].input_ids))
        m = self.config.train_micro_batch_size or len(order)
        return [order[i : i + m] for i in range(0, len(order), m)]

    def _model_pass(self, batch: types.PreparedModelPassBatch, with_grad: bool):
        rows, errors = batching.validate(batch, self._slot, self.model.config.vocab_size, self.max_seq_len)
        results: dict[str, types.ForwardBackwardOutput | types.ErrorResponse] = {}
        for r, message in errors.items():
            results[batch.request_batch_slices[r][0]] = types.ErrorResponse(error=message)
        if not rows:
            return results
        name = "forward_backward" if with_grad else "forward"
        key = (name, losses.names(), losses.config_keys())
        graphdef, lora, frozen = split_model(self.model)
        fn = self._fn(key, lambda: make_model_pass(graphdef, self.config.loss_chunk_size, with_grad, self._counted(name)))
        fsdp = self.mesh.shape["fsdp"]
        logprobs: list[np.ndarray] = [None] * len(rows)  # type: ignore[list-item]
        elementwise: list[np.ndarray] = [None] * len(rows)  # type: ignore[list-item]
        for idx in self._micro_batches(rows):
            chunk = [rows[i] for i in idx]
            num_rows = self.config.train_micro_batch_size or batching.bucket_rows(len(chunk), fsdp)
            seq_len = batching.bucket_length(max(len(r.input_ids) for r in chunk))
            arrays = batching.pack(chunk, num_rows, seq_len, len(losses.config_keys()))
            device_batch = {
                k: put_global(v, NamedSharding(self.mesh, batch_spec(v.ndim))) for k, v in arrays.items()
            }
            self._grad_sum, tlp_bt, loss_bt = self._run(name, fn, lora, frozen, self._grad_sum, device_batch)
            tlp_bt, loss_bt = to_host(tlp_bt), to_host(loss_bt)
            for b, i in enumerate(idx):
                n = len(rows[i].input_ids)
                logprobs[i], elementwise[i] = tlp_bt[b, :n], loss_bt[b, :n]
        if with_grad:
            for row in rows:
                model_id = batch.request_batch_slices[row.request_index][1]
                acc = self._accumulated.get(model_id)
                if acc is not None:
                    acc["sequences"] += 1
                    acc["tokens"] += len(row.input_ids)
        by_request: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_request.setdefault(row.request_index, []).append(i)
        for r, members in by_request.items():
            outputs = [
                {
                    "logprobs": types.TensorData.from_numpy(logprobs[i].astype(np.float32)),
                    "elementwise_loss": types.TensorData.from_numpy(elementwise[i].astype(np.float32)),
                }
                for i in members
            ]
            loss_sum = float(sum(elementwise[i].astype(np.float64).sum() for i in members))
            results[batch.request_batch_slices[r][0]] = types.ForwardBackwardOutput(
                loss_fn_outputs=outputs, metrics={"loss:sum": loss_sum}
            )
        return results

    # ---- optimizer ----

    def optim_step(self, model_id: str, request_data: types.OptimStepInput) -> types.OptimStepOutput:
        slot = self._slot(model_id)
        self._before_slot_change(model_id)  # snapshots served from this slot keep the weights they saved
        fn = self._fn(("optim_step",), lambda: make_optim_step(self._counted("optim_step")))
        hp = {k: jnp.float32(v) for k, v in request_data.adam_params.model_dump().items()}
        _, lora, _ = split_model(self.model)
        lora, self._grad_sum, self._opt_states[model_id], metrics = self._run(
            "optim_step", fn, lora, self._grad_sum, self._opt_states[model_id], jnp.int32(slot), hp
        )
        nnx.update(self.model, lora)
        acc = self._accumulated[model_id]
        out = {k: float(to_host(v)) for k, v in metrics.items()}
        out |= {"learning_rate": request_data.adam_params.learning_rate,
                "accumulated_sequences": float(acc["sequences"]), "accumulated_tokens": float(acc["tokens"])}
        self._reset_accumulation(model_id)  # the step itself zeroed the slot's gradient sums
        meta = self.models[model_id]
        self.models[model_id] = meta.model_copy(update={"optim_steps": meta.optim_steps + 1})
        return types.OptimStepOutput(metrics=out)

    # ---- sampling ----

    def sample(self, prepared_batch: types.PreparedSampleBatch):
        return self._sampler.sample(prepared_batch)
