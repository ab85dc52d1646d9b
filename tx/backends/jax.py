"""JaxBackend: one process's implementation of the backend contract over a (fsdp, ep, tp) mesh, for both
training modes.

The backend holds the mesh, the model, the runtime (compiled programs), request validation, token-budgeted
micro-batching, the jit-compiled model pass and the sampler. What is trained (LoRA adapters in the model's
slots, or every base weight) is its training state, `self.state`, chosen by `config.training_mode`:
`LoraSlotsState` (tx/backends/lora_state.py) or `FullWeightsState` (tx/backends/full_state.py). The
multi-host wrapper (tx/distributed/backend.py) broadcasts these calls.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from tx import losses, ranks, types
from tx.backends import batching
from tx.backends.base import AbstractBackend
from tx.backends.config import JaxBackendConfig
from tx.backends.full_state import FullWeightsState
from tx.backends.lora_state import LoraSlotsState
from tx.backends.slots import SlotTable
from tx.backends.state import TrainingState
from tx.backends.steps import make_model_pass
from tx.kernels.attention import warn_cudnn_packed
from tx.kernels.platform import platform_of
from tx.log import warn_once
from tx.models.loading import load_model, resolve_model_dir
from tx.models.sharding import batch_spec, describe_mesh, make_mesh, put_global, to_host
from tx.runtime import Runtime
from tx.sampling.sampler import Sampler

logger = logging.getLogger(__name__)

# training_mode -> the training state that serves it
TRAINING_STATES: dict[str, type[TrainingState]] = {"lora": LoraSlotsState, "full": FullWeightsState}


class JaxBackend(AbstractBackend):
    training_mode = "lora"  # the config's training_mode this class serves (FullBackend: "full")

    def __init__(self, base_model: str, config: JaxBackendConfig | None = None, run_id: str | None = None):
        self.base_model = base_model
        # Names this backend creates (checkpoint versions) are run_id + a counter: equal on every host
        # when the coordinator hands all hosts the same run_id.
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self._names = 0
        config = config or JaxBackendConfig(training_mode=self.training_mode)
        if config.training_mode != self.training_mode:
            raise ValueError(f"training_mode={config.training_mode!r} is served by "
                             f"{'tx.backends.full.FullBackend' if config.training_mode == 'full' else 'JaxBackend'}, "
                             f"not {type(self).__name__}")
        state_type = TRAINING_STATES[self.training_mode]
        self.config = config = state_type.configure(config)
        self.mesh = build_mesh(config)
        self.platform = platform_of(self.mesh)  # what every program of this backend is built for (static)
        fsdp = self.mesh.shape["fsdp"]
        if config.train_micro_batch_size % fsdp:
            raise ValueError(
                f"train_micro_batch_size={config.train_micro_batch_size} must be a multiple of the mesh's fsdp size "
                f"{fsdp} (fully_sharded_data_parallel_size={config.fully_sharded_data_parallel_size}): each call's "
                "rows are split over the fsdp devices"
            )
        self.model_dir = resolve_model_dir(base_model)
        self._model_options = state_type.model_options(config)
        self.model = self.load_base()
        self.max_seq_len = config.max_seq_len or self.model.config.max_position_embeddings
        self.models: dict[str, types.ModelMetadata] = {}
        self._accumulated: dict[str, dict[str, float]] = {}
        self.metrics = types.EngineMetrics()
        self.runtime = Runtime(self.mesh, self.metrics, config.enforce_eager)
        self.programs = self.runtime.programs  # each program's last call, once enabled: tests lower the real programs
        self._planned_shapes: dict[str, set[tuple[int, int]]] = {}  # per pass: micro-batch shapes planned so far
        self.state: TrainingState = state_type(self)
        self.sampler = Sampler(self, self.runtime, config)

    def load_base(self, dtype: str | None = None) -> nnx.Module:
        """The base model from `model_dir` on the mesh, as the training state asks (its LoRA slots, dtype and
        expert layout; `dtype` overrides the dtype), with this backend's kernels."""
        config = self.config
        return load_model(
            self.model_dir,
            mesh=self.mesh,
            remat_policy=config.remat_policy if config.gradient_checkpointing else "none",
            attention_impl=config.attention_impl,
            moe_impl=config.moe_impl,
            shard_attention_heads=config.shard_attention_heads,
            rules=config.logical_axis_rules,
            platform=self.platform,
            **self._model_options | ({"dtype": dtype} if dtype else {}),
        )

    # ---- bookkeeping ----

    def sample_slot(self, model_id: str) -> int:
        """The slot a sampling row of `model_id` reads ("" = the base model, slot 0)."""
        return self.state.sample_slot(model_id)

    def sampler_slot(self, path: str, pinned: set[int]) -> int:
        """The slot holding sampler checkpoint `path` (see the training state's)."""
        return self.state.sampler_slot(path, pinned)

    def kv_identity(self, slot: int, tenant: str = "") -> str | None:
        """Names the weights rows of `slot` are computed with now (the prefix cache keys KV pages by it)."""
        return self.state.kv_identity(slot, tenant)

    def holds_snapshot(self, path: str) -> bool:
        """Whether sampler checkpoint `path` is held in memory (sampled without reading the disk)."""
        return self.state.holds_snapshot(path)

    @property
    def slots(self) -> SlotTable:
        return self.state.slots

    def debug_fail(self, message: str, process_ids: list[int], phase: str = "execute") -> None:
        """Fault injection for multi-host tests: raise `message` on the listed processes."""
        if phase == "execute" and ranks.launch_rank() in process_ids:
            raise RuntimeError(message)

    def unique_name(self) -> str:
        self._names += 1
        return f"{self.run_id}-{self._names:06d}"

    def _reset_accumulation(self, model_id: str, grads: bool = False) -> None:
        """Forget what the model accumulated since its last step: counters, and with `grads` its gradient sums."""
        if grads:
            self.state.reset_grads(model_id)
        self._accumulated[model_id] = {"sequences": 0, "tokens": 0}

    def has_model(self, model_id: str) -> bool:
        return model_id in self.models

    # ---- models ----

    def create_model(self, model_id: str, lora_config: types.LoraConfig) -> None:
        if model_id in self.models:
            raise ValueError(f"model_id {model_id!r} already exists")
        self.models[model_id] = self.state.create(model_id, lora_config)
        self._reset_accumulation(model_id)

    def delete_model(self, model_id: str) -> None:
        self.state.delete(model_id)
        del self.models[model_id], self._accumulated[model_id]

    def grad_sum_of(self, model_id: str) -> dict:
        """The model's accumulated gradient sums, `{"dotted.path": array}` (for inspection)."""
        return self.state.grad_sum_of(model_id)

    def grad_sum_bytes(self) -> int:
        """Bytes of the gradient sums this backend holds (global sizes, over all devices)."""
        return self.state.grad_sum_bytes()

    def opt_state_of(self, model_id: str) -> Any:
        return self.state.opt_state_of(model_id)

    # ---- forward / backward ----

    def forward_backward(self, prepared_batch: types.PreparedModelPassBatch):
        return self._model_pass(prepared_batch, with_grad=True)

    def forward(self, prepared_batch: types.PreparedModelPassBatch):
        return self._model_pass(prepared_batch, with_grad=False)

    def _micro_batches(self, name: str, rows: list[batching.Row]) -> list[list[int]]:
        """Row indices per jit call: rows of all requests sorted by length and packed under the token
        budget (see `batching.plan_micro_batches`). A shape this pass has not planned before costs a
        budget's worth of tokens (its compile). The plan depends only on the batch, the config and the
        earlier calls' plans, so every host computes the same one."""
        fsdp, cap, budget = self.mesh.shape["fsdp"], self.config.train_micro_batch_size, self.config.train_micro_batch_tokens
        lengths = [len(r.input_ids) for r in rows]
        known = self._planned_shapes.setdefault(name, set())
        plan = batching.plan_micro_batches(lengths, budget, cap, fsdp, known_shapes=known, new_shape_cost=budget)
        known.update(batching.micro_batch_shape([lengths[i] for i in group], fsdp, cap) for group in plan)
        return plan

    def forward_backward_planned(self, prepared_batch: types.PreparedModelPassBatch, plan: list[list[int]]):
        """forward_backward with the micro-batches given (row indices per jit call; the first runs the
        "grads" program, the others "accumulate") instead of planned: `tx.backends.precompile` compiles
        each program of a shape this way."""
        return self._model_pass(prepared_batch, with_grad=True, plan=plan)

    def _model_pass(self, batch: types.PreparedModelPassBatch, with_grad: bool, plan: list[list[int]] | None = None):
        """All-or-nothing per call: gradients go into a temporary; if any micro-batch raises, the sums and
        counters are untouched. A request whose outputs are not finite fails, and so do the other requests
        of its model in this call (their gradients are mixed in the same slot): that slot is not committed."""
        # forward may read the base model (model id "", slot 0: e.g. an RL reference policy); it is never trained
        slot_of = self.state.slot if with_grad else self.state.sample_slot
        rows, errors = batching.validate(batch, slot_of, self.model.config.vocab_size, self.max_seq_len)
        results: dict[str, types.ForwardBackwardOutput | types.ErrorResponse] = {}
        for r, message in errors.items():
            results[batch.request_batch_slices[r][0]] = types.ErrorResponse(error=message)
        if not rows:
            return results
        if self.config.attention_impl == "cudnn" and any(r.segment_ids[0] != r.segment_ids[-1] for r in rows):
            warn_cudnn_packed(self.platform)  # those micro-batches run blockwise (decided on device)
        name = "forward_backward" if with_grad else "forward"
        graphdef, lora, frozen = self.state.split_trainable(self.model)
        loss_names = batching.loss_names_of(rows)  # one program per set of losses present, evaluating only those
        extra_keys = losses.extra_input_keys(loss_names)
        aux = tuple(k for k in losses.AUX_INPUTS if any(k in losses.get(r.loss).aux for r in rows))
        tempered = any(r.temperature != 1.0 for r in rows)
        with_logprobs = any(losses.get(r.loss).needs_logprobs for r in rows)
        head_lora = self._head_adapted({r.adapter for r in rows})
        fns = {
            mode: self.runtime.program((mode, loss_names, losses.version(), extra_keys, aux, tempered, with_logprobs,
                                        head_lora),
                                       lambda mode=mode: make_model_pass(graphdef, self.config.loss_chunk_size, mode,
                                                                         self.runtime.counted(name), self.state.grad_dtype,
                                                                         extra_keys, aux, tempered, with_logprobs,
                                                                         head_lora, loss_names))
            for mode in (("grads", "accumulate") if with_grad else ("forward",))
        }
        fsdp = self.mesh.shape["fsdp"]
        logprobs: list[np.ndarray] = [None] * len(rows)  # type: ignore[list-item]
        elementwise: list[np.ndarray] = [None] * len(rows)  # type: ignore[list-item]
        aux_out: list[dict[str, np.ndarray]] = [{} for _ in rows]
        acc = None  # this call's gradients, committed below only once every micro-batch succeeded
        for idx in plan if plan is not None else self._micro_batches(name, rows):
            chunk = [rows[i] for i in idx]
            num_rows, seq_len = batching.micro_batch_shape(
                [len(r.input_ids) for r in chunk], fsdp, self.config.train_micro_batch_size)
            arrays = batching.pack(chunk, num_rows, seq_len, loss_names)
            self.runtime.count_tokens(name, sum(len(r.input_ids) for r in chunk), num_rows * seq_len)
            device_batch = {
                k: put_global(v, NamedSharding(self.mesh, batch_spec(v.ndim))) for k, v in arrays.items()
            }
            if not with_grad:
                tlp_bt, loss_bt, aux_bt = self.runtime.run(name, fns["forward"], lora, frozen, device_batch)
            elif acc is None:
                acc, tlp_bt, loss_bt, aux_bt = self.runtime.run(name, fns["grads"], lora, frozen, device_batch)
            else:
                acc, tlp_bt, loss_bt, aux_bt = self.runtime.run(name, fns["accumulate"], lora, frozen, acc, device_batch)
            tlp_bt, loss_bt = to_host(tlp_bt), to_host(loss_bt)
            aux_bt = {k: to_host(v) for k, v in aux_bt.items()}
            for b, i in enumerate(idx):
                n = len(rows[i].input_ids)
                cols = rows[i].targets.shape[1] if rows[i].targets.ndim == 2 else None  # [n, K] in, [n, K] out
                logprobs[i] = tlp_bt[b, :n, :cols] if cols else tlp_bt[b, :n, 0]
                elementwise[i] = loss_bt[b, :n]
                for k in losses.get(rows[i].loss).aux:  # what the row's loss reads, returned
                    aux_out[i][k] = aux_bt[k][b, :n]
        by_request: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_request.setdefault(row.request_index, []).append(i)
        failed = {r: message for r, members in by_request.items()
                  if (message := batching.non_finite_output(rows, members, logprobs, elementwise))}
        if with_grad:
            failed |= self._commit(batch, rows, by_request, failed, acc)
            acc = None  # the call's temporary is freed here, not kept beside the sums
        for r, members in by_request.items():
            request_id = batch.request_batch_slices[r][0]
            if r in failed:
                results[request_id] = types.ErrorResponse(error=failed[r])
                continue
            outputs = [
                ({"logprobs": types.TensorData.from_numpy(logprobs[i].astype(np.float32))}
                 if losses.get(rows[i].loss).needs_logprobs else {})
                | {"elementwise_loss": types.TensorData.from_numpy(elementwise[i].astype(np.float32))}
                | {k: types.TensorData.from_numpy(v.astype(np.float32)) for k, v in aux_out[i].items()}
                for i in members
            ]
            loss_sum = float(sum(elementwise[i].astype(np.float64).sum() for i in members))
            results[request_id] = types.ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={"loss:sum": loss_sum})
        return results

    def _head_adapted(self, slots: set[int]) -> bool:
        """Whether any of `slots` has a LoRA delta on the LM head (a non-zero scale: it trains the head, or
        loaded weights for it); where none does, passes skip the head's delta, exactly zero for them."""
        scale_a = to_host(self.model.head_lora_scale())
        return bool(np.any(scale_a[sorted(slots)] != 0))

    def _commit(self, batch, rows, by_request: dict[int, list[int]], failed: dict[int, str], acc) -> dict[int, str]:
        """Add the call's gradients `acc` into the sums of the slots whose requests all succeeded and whose
        new sums are finite, then count their rows. Returns the requests that fail on top of `failed`."""
        model_of = {r: batch.request_batch_slices[r][1] for r in by_request}
        slot_of = {r: rows[members[0]].adapter for r, members in by_request.items()}
        bad_slots = {slot_of[r] for r in failed}
        committed = self.state.commit(acc, {s for s in slot_of.values() if s not in bad_slots})
        more: dict[int, str] = {}
        for r, slot in slot_of.items():
            members = by_request[r]
            if r in failed:
                continue
            if slot in bad_slots:
                more[r] = (f"another request of model {model_of[r]!r} in the same pass failed with non-finite "
                           "outputs; this pass's gradients for the model were dropped, retry this request")
            elif slot not in committed:
                more[r] = (f"the gradient sums of model {model_of[r]!r} would not be finite in float32 after this "
                           f"pass ({batching.largest_inputs(rows, members)}); this pass's gradients for it were dropped")
        for r, members in by_request.items():
            acc_counts = self._accumulated.get(model_of[r])
            if r not in failed and r not in more and acc_counts is not None:
                acc_counts["sequences"] += len(members)
                acc_counts["tokens"] += sum(len(rows[i].input_ids) for i in members)
        return more

    # ---- optimizer ----

    def optim_step(self, model_id: str, request_data: types.OptimStepInput) -> types.OptimStepOutput:
        hp = {k: jnp.float32(v) for k, v in request_data.adam_params.model_dump().items()}
        metrics, ok = self.state.optim_step(model_id, hp)
        return self._finish_step(model_id, request_data, metrics, ok)

    def _finish_step(self, model_id: str, request_data: types.OptimStepInput, metrics: dict,
                     ok: jax.Array) -> types.OptimStepOutput:
        """Refuse a step the device kept out (not finite), else report it and start the next accumulation."""
        if not bool(to_host(ok)):
            # The step kept weights, Adam state and gradient sums as they were: a retry may use a smaller lr.
            raise ValueError(
                f"optim_step of model {model_id!r} refused: the update is not finite in float32 "
                f"(learning_rate={request_data.adam_params.learning_rate}, "
                f"grad_norm={float(to_host(metrics['grad_norm']))}); weights, Adam state and gradient sums "
                "are unchanged")
        acc = self._accumulated[model_id]
        out = {k: float(to_host(v)) for k, v in metrics.items()}
        out |= {"learning_rate": request_data.adam_params.learning_rate,
                "accumulated_sequences": float(acc["sequences"]), "accumulated_tokens": float(acc["tokens"])}
        self._reset_accumulation(model_id)  # the step itself zeroed the gradient sums
        meta = self.models[model_id]
        self.models[model_id] = meta.model_copy(update={"optim_steps": meta.optim_steps + 1})
        return types.OptimStepOutput(metrics=out)

    # ---- checkpoints ----

    def save_checkpoint(self, output_path, model_id: str) -> None:
        """Save the model's training state (weights and optimizer) to `output_path`."""
        self.state.save_checkpoint(output_path, model_id)

    def checkpoint_metadata(self, checkpoint_path) -> dict:
        """Metadata of a training checkpoint (its LoraConfig lets an engine recreate the model first)."""
        return self.state.checkpoint_metadata(checkpoint_path)

    def load_checkpoint(self, checkpoint_path, model_id: str, load_optimizer: bool = True) -> None:
        """Restore the model's training state; nothing changes if reading or validating it fails."""
        update = self.state.load_checkpoint(checkpoint_path, model_id, load_optimizer)
        self._reset_accumulation(model_id, grads=True)
        self.models[model_id] = self.models[model_id].model_copy(update=update)

    def save_sampler_checkpoint(self, output_path, model_id: str, persist: bool = True) -> None:
        self.state.save_sampler_checkpoint(output_path, model_id, persist)

    def evict_sampler_checkpoint(self, path) -> None:
        """Forget sampler checkpoint `path` (its files were deleted)."""
        self.state.evict_sampler_checkpoint(path)

    def save_external_weights(self, output_path, model_id: str, age_recipients: list[str] | None = None) -> None:
        """The model's weights for use outside tx (PEFT adapter or HF model), age-encrypted when asked."""
        self.state.save_external_weights(output_path, model_id, age_recipients)

    # ---- sampling ----

    def sample(self, prepared_batch: types.PreparedSampleBatch):
        return self.sampler.sample(prepared_batch)

    def sample_submit(self, prepared_batch: types.PreparedSampleBatch) -> dict[str, types.ErrorResponse]:
        """Queue sampling requests that run alongside those already running (`sample_step` advances them);
        the requests refused, each with its error."""
        return self.sampler.submit(prepared_batch)

    def sample_step(self) -> dict[str, types.SampleOutput]:
        """Advance the queued sampling requests by one engine iteration (a prefill chunk call and a few
        decode steps); the requests that finished."""
        return self.sampler.step()

    @property
    def sampling_active(self) -> bool:
        return self.sampler.active


def build_mesh(config: JaxBackendConfig) -> Mesh:
    """The config's (fsdp, ep, tp) mesh over the run's devices (every device of every process by default),
    logged; a mesh the user sized smaller than the run is logged once with the devices it leaves idle."""
    num_devices, num_processes = jax.device_count(), jax.process_count()
    shape = config.mesh_shape(num_devices, num_processes)
    mesh = make_mesh(shape.fsdp, shape.ep, shape.tp, jax.devices()[:shape.size])
    described = describe_mesh(mesh, num_devices, num_processes)
    if shape.idle:
        warn_once(("idle_devices", shape), f"mesh {described}: {shape.idle} of the {num_devices} devices stay idle "
                  f"(fully_sharded_data_parallel_size={config.fully_sharded_data_parallel_size}, "
                  f"expert_parallel_size={config.expert_parallel_size}, "
                  f"tensor_parallel_size={config.tensor_parallel_size}; -1 = the devices the others leave)",
                  logger=logger)
    logger.info("mesh %s", described)
    return mesh
