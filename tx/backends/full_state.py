"""FullWeightsState: full fine-tuning's training state (`training_mode="full"`): one model at a time trains every
base weight.

What differs from LoRA slots (tx/backends/lora_state.py) lives here: what is differentiated (the base
`nnx.Param`s instead of the LoRA factors), the gradient sums and Adam state (one model's, shaped and sharded like
the weights), create/delete (take and restore the base weights) and what may be sampled (not the base model,
whose weights are being trained). The backend (tx/backends/jax.py) shares everything else with LoRA.

Precision (`config.mixed_precision`, the seed's MixedPrecisionConfig): with `param_dtype="fp32"` the model's
own weights are the optimizer's parameters; with "bf16" the model holds bf16 weights (what forward, backward
and sampling compute with) and the optimizer float32 master copies, and each step writes the bf16 cast of the
new masters into the model. A micro-batch's gradients are computed in the param dtype (as FSDP's mixed
precision does), then cast to float32 and summed in float32 across micro-batches and calls (`reduce_dtype`).
Adam moments are float32, sharded like the weights. `optim_step` donates masters, model weights, gradient sums
and moments, so a step needs no second copy of any of them.

Hyperparameters come per step in Tinker's AdamParams, as for LoRA: the seed's OptimizerConfig maps onto them
(lr -> learning_rate, adam_betas -> beta1/beta2, weight_decay, max_grad_norm -> grad_clip_norm); its
num_warmup_steps/scheduler are the caller's schedule of learning_rate (e.g. tx.sft).

The model still carries LoRA slots, the smallest (`FULL_MODE_LORA_SLOTS`: 2 slots of rank 1; every row reads
slot 0, which stays zero): tx's model layers are built with stacked adapter slots that the model pass and the
sampler gather per row, and `load_model` has no slot-free variant. `configure` writes those values into the
config (so it says what runs, also on the workers), logging once a different value the user gave.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections import OrderedDict
from functools import partial
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tx import ranks, types
from tx.backends.config import FULL_MODE_LORA_SLOTS, JaxBackendConfig, MixedPrecisionConfig, full_mode_lora_slots
from tx.backends.slots import SlotTable
from tx.backends.state import StateHost
from tx.backends.steps import adamw, all_finite, clip_metrics, init_adamw_state
from tx.checkpoints import external, storage, training
from tx.checkpoints.full import (SAMPLER_FORMAT as FULL_SAMPLER_FORMAT, abstract_state, export_hf_model,
                                 load_full_checkpoint, read_full_metadata, save_full_checkpoint, save_sampler_model)
from tx.models.config import LoraSlots
from tx.models.layers.lora import LoraA, LoraB
from tx.models.sharding import to_host

logger = logging.getLogger(__name__)

DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
LOAD_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
FULL_ADAPTER = 0  # rows of the full model read LoRA slot 0, which stays zero: the plain (trained) weights


def is_base_param(_path, value) -> bool:
    """nnx filter: the trainable weights of full fine-tuning (every Param that is not a LoRA factor)."""
    return isinstance(value, nnx.Param) and not isinstance(value, (LoraA, LoraB))


def split_full(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, base weights, everything else)."""
    return nnx.split(model, is_base_param, ...)


@partial(jax.jit, donate_argnums=(0,))
def commit_grads(grad_sum: Any, acc: Any) -> tuple[Any, jax.Array]:
    """`grad_sum + acc` if all of it is finite, else `grad_sum` unchanged; `grad_sum` is donated (updated in
    place), the caller drops `acc` right after."""
    finite = all_finite(jax.tree.map(jnp.add, grad_sum, acc))
    return jax.tree.map(lambda g, a: jnp.where(finite, g + a, g), grad_sum, acc), finite


def make_full_optim_step(param_dtype: Any, on_trace: Callable[[], None]) -> Callable:
    """`(master, compute, grad_sum, opt_state, hp) -> (master, compute, grad_sum, opt_state, metrics, ok)`.

    `compute` is the model's bf16 copy of the masters (None when the masters are the model's weights).
    Clipping and AdamW as for LoRA (`steps.make_optim_step`); the step is committed only if the new
    weights, moments and metrics are finite, otherwise every output equals its input bit for bit.

    Two passes: the first only reduces the update (norms, finiteness), the second, under `lax.cond(ok)`,
    recomputes it and writes it. Selecting with `where(ok, new, old)` instead would hold the whole new
    state (weights and both moments) beside the old one: XLA's temporaries of this step measured 4.0x the
    weights' bytes that way, 2.0x with the cond (8 x 64 MiB float32 leaves, CPU)."""

    def step(master, compute, grad_sum, opt_state, hp):
        on_trace()
        metrics = clip_metrics(grad_sum, hp)

        def update():
            clipped = jax.tree.map(lambda g: g * metrics["grad_clip_scale"], grad_sum)
            updates, new_state = adamw(hp).update(clipped, opt_state, master)
            return optax.apply_updates(master, updates), new_state, updates

        new_master, new_state, updates = update()
        metrics = metrics | {"update_norm": optax.tree.norm(updates), "param_norm": optax.tree.norm(new_master)}
        ok = all_finite((new_master, new_state, metrics))

        def commit():
            m, s, _ = update()
            c = None if compute is None else jax.tree.map(lambda x: x.astype(param_dtype), m)
            return m, c, jax.tree.map(jnp.zeros_like, grad_sum), s

        master, compute, grad_sum, opt_state = jax.lax.cond(
            ok, commit, lambda: (master, compute, grad_sum, opt_state))
        return master, compute, grad_sum, opt_state, metrics, ok

    return jax.jit(step, donate_argnums=(0, 1, 2, 3))


class FullWeightsState:
    training_mode = "full"
    grad_dtype = jnp.float32  # reduce_dtype: every micro-batch's gradients leave the pass in float32

    @staticmethod
    def configure(config: JaxBackendConfig) -> JaxBackendConfig:
        # The config's validation already did this; a config copied into training_mode="full" (model_copy
        # skips validation) gets the full mode's LoRA slots here (a value the user gave is logged once).
        return config.model_copy(update=full_mode_lora_slots(config) | {
            "mixed_precision": config.mixed_precision or MixedPrecisionConfig()})

    @staticmethod
    def model_options(config: JaxBackendConfig) -> dict[str, Any]:
        """Weights in the param dtype, expert kernels scanned per layer (they train), the smallest LoRA slots."""
        return {"slots": LoraSlots(**FULL_MODE_LORA_SLOTS), "experts_whole": False,
                "dtype": LOAD_DTYPES[config.mixed_precision.param_dtype]}

    def __init__(self, host: StateHost):
        self.host = host
        self.precision: MixedPrecisionConfig = host.config.mixed_precision
        self.param_dtype = DTYPES[self.precision.param_dtype]
        self.slots = SlotTable(1)  # slot 0 only: the live weights; no slot to lend a sampler checkpoint
        self.grad_sum = None  # the live model's float32 gradient sums
        self.master: nnx.State | None = None  # float32 masters when param_dtype is bf16
        self.opt_state: Any = None
        self.live: str | None = None
        self.weights_version = 0  # bumped whenever the live weights change: sampler saves name a version
        self.init_saves()

    def split_trainable(self, model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
        return split_full(model)

    def slot(self, model_id: str) -> int:
        if model_id not in self.host.models:
            live = f"; the live model is {self.live!r}" if self.live else ""
            raise KeyError(f"unknown model_id {model_id!r}{live}")
        return FULL_ADAPTER

    def kv_identity(self, slot: int, tenant: str = "") -> str | None:
        # the one live model's weights (its owner's alone), or the base model's before one is created
        return f"full:{self.weights_version}" + (f":{tenant}" if tenant else "")

    def sample_slot(self, model_id: str) -> int:
        if not model_id:
            owner = f" by model {self.live!r}" if self.live else ""
            raise ValueError(f"training_mode='full': the base model (model id '') cannot be sampled, its weights "
                             f"are trained{owner}; sample with the model's id")
        return self.slot(model_id)

    # ---- the model ----

    def create(self, model_id: str, lora_config: types.LoraConfig) -> types.ModelMetadata:
        if self.live is not None:
            raise ValueError(f"training_mode='full' trains one model at a time: model {self.live!r} is live; "
                             f"delete it before creating {model_id!r}")
        _, params, _ = split_full(self.host.model)
        master = None
        if self.param_dtype != jnp.float32:  # float32 masters read from the checkpoint, not cast up from bf16
            _, master, _ = split_full(self.host.load_base(dtype="float32"))
        self.grad_sum = jax.tree.map(lambda x: jnp.zeros_like(x, dtype=jnp.float32), params)
        self.opt_state = init_adamw_state(params if master is None else master, self.host.mesh)
        self.master = master
        self.live = model_id
        logger.info("created full model %s (param_dtype %s; LoRA rank %d ignored)", model_id,
                    self.precision.param_dtype, lora_config.rank)
        return types.ModelMetadata(model_id=model_id, adapter_index=FULL_ADAPTER, lora_config=lora_config)

    def delete(self, model_id: str) -> None:
        """Drop the model's optimizer state and sums and restore the base weights, re-read from the checkpoint."""
        self.slot(model_id)
        self.host.sampler.before_weights_change(FULL_ADAPTER)
        self.grad_sum = self.master = self.opt_state = None
        self.live = None
        _, base, _ = split_full(self.host.load_base())
        nnx.update(self.host.model, base)
        self.weights_version += 1
        self.forget_saves(model_id)
        logger.info("deleted full model %s; base weights restored from %s", model_id, self.host.model_dir)

    def master_weights(self, model_id: str) -> nnx.State:
        """The optimizer's float32 weights: the masters (bf16 params) or the model's own weights (fp32)."""
        self.slot(model_id)
        return self.master if self.master is not None else split_full(self.host.model)[1]

    def set_weights(self, master: nnx.State) -> None:
        """New float32 weights: the model's own (fp32), or the masters and their cast into the model (bf16)."""
        self.host.sampler.before_weights_change(FULL_ADAPTER)
        if self.master is None:
            nnx.update(self.host.model, master)
        else:
            self.master = master
            nnx.update(self.host.model, jax.tree.map(lambda m: m.astype(self.param_dtype), master))
        self.weights_version += 1

    def state_bytes(self) -> dict[str, int]:
        """Bytes the training state holds on this process's first device, per kind (model weights, float32
        masters, gradient sums, Adam moments): with fsdp sharding, about the total / fsdp."""
        device = self.host.mesh.devices.flat[0]

        def on_device(tree) -> int:
            return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in getattr(x, "addressable_shards", [])
                       if s.device == device)

        return {"params": on_device(split_full(self.host.model)[1]), "masters": on_device(self.master),
                "grad_sums": on_device(self.grad_sum), "adam": on_device(self.opt_state)}

    # ---- gradients ----

    def reset_grads(self, model_id: str) -> None:
        self.slot(model_id)
        self.grad_sum = jax.tree.map(jnp.zeros_like, self.grad_sum)

    def commit(self, acc: Any, allowed: set[int]) -> set[int]:
        """All rows are the one model's (slot 0): its sums take the call's gradients if allowed and finite."""
        if FULL_ADAPTER not in allowed:
            return set()
        self.grad_sum, finite = commit_grads(self.grad_sum, acc)
        return {FULL_ADAPTER} if bool(to_host(finite)) else set()

    def grad_sum_of(self, model_id: str) -> dict:
        """The model's float32 gradient sums, `{"dotted.path": array}` (for inspection)."""
        self.slot(model_id)
        return {".".join(map(str, path)): to_host(v.get_value()) for path, v in nnx.to_flat_state(self.grad_sum)}

    def grad_sum_bytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.grad_sum))

    def opt_state_of(self, model_id: str) -> Any:
        self.slot(model_id)
        return self.opt_state

    # ---- optimizer ----

    def optim_step(self, model_id: str, hp: dict[str, jax.Array]) -> tuple[dict, jax.Array]:
        self.slot(model_id)
        self.host.sampler.before_weights_change(FULL_ADAPTER)  # requests reading these weights finish first
        runtime = self.host.runtime
        fn = runtime.program(("full_optim_step",), lambda: make_full_optim_step(self.param_dtype,
                                                                                 runtime.counted("optim_step")))
        _, params, _ = split_full(self.host.model)
        master, compute = (params, None) if self.master is None else (self.master, params)
        master, compute, self.grad_sum, self.opt_state, metrics, ok = runtime.run(
            "optim_step", fn, master, compute, self.grad_sum, self.opt_state, hp)
        if self.master is None:
            nnx.update(self.host.model, master)
        else:
            self.master = master
            nnx.update(self.host.model, compute)
        if bool(to_host(ok)):  # a refused step leaves the weights (and their sampler saves) as they were
            self.weights_version += 1
        return metrics, ok

    # ---- checkpoints ----
    #
    # Training state: the float32 weights (masters, or the model's own in fp32), the AdamW state and the step,
    # with orbax (tx/checkpoints/full.py), restorable onto another mesh. Sampler weights: the weights the model
    # computes with, as an HF safetensors model (tar, or a marker with persist=False). There is one copy of the
    # weights, so a sampler path is served while the live weights are still the ones it saved (no optim_step
    # or load since); an older save is refused with a message, not silently served newer weights.

    def save_checkpoint(self, output_path, model_id: str) -> None:
        self.slot(model_id)
        meta = self.host.models[model_id]
        save_full_checkpoint(
            output_path, self.master_weights(model_id), self.opt_state, meta.optim_steps,
            {"base_model": self.host.base_model, "base": training.base_signature(self.host.model.config),
             "training_mode": "full", "param_dtype": self.precision.param_dtype,
             "lora_config": meta.lora_config.model_dump(), "saved_at": time.time()},
            version=self.host.unique_name())
        logger.info("saved full training checkpoint of %s (step %d) to %s", model_id, meta.optim_steps, output_path)

    def checkpoint_metadata(self, checkpoint_path) -> dict:
        return read_full_metadata(checkpoint_path)

    def load_checkpoint(self, checkpoint_path, model_id: str, load_optimizer: bool = True) -> dict:
        """Restore weights (and the AdamW state unless `load_optimizer=False`) exactly, onto this mesh. The
        live state is kept until the whole checkpoint is read and validated, so a failed load changes
        nothing; the peak is therefore two copies of the float32 training state while it loads."""
        self.slot(model_id)
        ckpt = load_full_checkpoint(
            checkpoint_path, abstract_state(self.master_weights(model_id)),
            abstract_state(self.opt_state) if load_optimizer else None,
            expected_base=training.base_signature(self.host.model.config))
        self.set_weights(ckpt.params)
        self.opt_state = ckpt.opt_state if load_optimizer else init_adamw_state(ckpt.params, self.host.mesh)
        logger.info("loaded %s into %s (step %d, optimizer: %s)", checkpoint_path, model_id, ckpt.step, load_optimizer)
        return {"lora_config": types.LoraConfig(**ckpt.metadata["lora_config"]), "optim_steps": ckpt.step}

    def export_info(self, model_id: str, **extra) -> dict:
        return {"model_id": model_id, "base_model": self.host.base_model, "base": training.base_signature(self.host.model.config),
                "optim_steps": self.host.models[model_id].optim_steps, "param_dtype": self.precision.param_dtype,
                "saved_at": time.time(), **extra}

    def save_sampler_checkpoint(self, output_path, model_id: str, persist: bool = True) -> None:
        """An HF safetensors model of the weights sampling uses (a tar at `output_path`), or with
        persist=False a marker; either way `output_path` samples the live weights until they change."""
        self.slot(model_id)
        info = self.export_info(model_id, persisted=persist)
        if persist:
            save_sampler_model(output_path, self.host.model, self.host.model_dir, info)
        elif ranks.is_primary_writer():
            with tempfile.TemporaryDirectory() as tmp:
                marker = Path(tmp) / "marker.json"
                marker.write_text(json.dumps({"format": FULL_SAMPLER_FORMAT, **info}))
                storage.write_file_atomic(output_path, marker)
        key = str(output_path)
        self.saved.pop(key, None)
        self.saved[key] = (model_id, self.weights_version, info["optim_steps"])
        while len(self.saved) > 4096:
            self.saved.popitem(last=False)

    def init_saves(self) -> None:
        self.saved: OrderedDict[str, tuple[str, int, int]] = OrderedDict()  # path -> (model, version, step)

    def forget_saves(self, model_id: str) -> None:
        for key in [k for k, saved in self.saved.items() if saved[0] == model_id]:
            del self.saved[key]

    def evict_sampler_checkpoint(self, path) -> None:
        self.saved.pop(str(path), None)

    def holds_snapshot(self, path: str) -> bool:
        return False  # no copies: a save is served from the live weights while they are the saved ones

    def sampler_slot(self, path: str, pinned: set[int]) -> int:
        saved = self.saved.get(path)
        if saved is None:
            raise ValueError(f"sampler checkpoint {path}: training_mode='full' samples only the live model's "
                             "latest saved weights, and this is not a save of them; to sample an exported model, "
                             "serve its directory with `python -m tx.run --base-model <dir>`")
        model_id, version, step = saved
        if model_id != self.live or version != self.weights_version:
            now = f"now at step {self.host.models[self.live].optim_steps}" if self.live else "since deleted"
            raise ValueError(f"sampler checkpoint {path} holds model {model_id!r}'s weights of step {step}, which "
                             f"have changed since ({now}); training_mode='full' keeps one copy of the weights, so "
                             "only a save made after the last optim_step or load can be sampled: save the weights "
                             "for the sampler again")
        return FULL_ADAPTER

    def save_external_weights(self, output_path, model_id: str, age_recipients: list[str] | None = None) -> None:
        """The model as an HF safetensors directory at `output_path`, each file age-encrypted to
        `age_recipients` when given. Every process gathers, process 0 writes."""
        self.slot(model_id)
        external.parse_recipients(age_recipients)  # on every process: refused before any collective gather
        with tempfile.TemporaryDirectory() as tmp:
            hf = Path(tmp) / "model"
            export_hf_model(hf, self.host.model, self.host.model_dir)
            if not ranks.is_primary_writer():
                return
            (hf / "tx_metadata.json").write_text(json.dumps(self.export_info(model_id), indent=2))
            external.publish_dir(hf, output_path, age_recipients)
        logger.info("saved external weights (HF model) of %s to %s", model_id, output_path)


