"""FullBackend: full fine-tuning — one model at a time trains every base weight (`training_mode="full"`).

Why a subclass of JaxBackend in its own module rather than a switch inside jax.py: the two modes share the
mesh, the loading, request validation, token-budgeted micro-batching, the jit-compiled model pass
(`steps.make_model_pass`) and the sampler, and differ in exactly the parts overridden here: what is
differentiated (the base `nnx.Param`s instead of the LoRA factors), the gradient sums and Adam state (one
model's, shaped and sharded like the weights, instead of per adapter slot), create/delete (take and restore
the base weights) and what may be sampled (not the base model, whose weights are being trained). Keeping
these here leaves jax.py about LoRA only.

Precision (`config.mixed_precision`, the seed's MixedPrecisionConfig): with `param_dtype="fp32"` the model's
own weights are the optimizer's parameters; with "bf16" the model holds bf16 weights (what forward, backward
and sampling compute with) and the optimizer float32 master copies, and each step writes the bf16 cast of the
new masters into the model. A micro-batch's gradients are computed in the param dtype (as FSDP's mixed
precision does), then cast to float32 and summed in float32 across micro-batches and calls (`reduce_dtype`). Adam moments are float32, sharded like the weights. `optim_step` donates masters,
model weights, gradient sums and moments, so a step needs no second copy of any of them.

Hyperparameters come per step in Tinker's AdamParams, as for LoRA: the seed's OptimizerConfig maps onto them
(lr -> learning_rate, adam_betas -> beta1/beta2, weight_decay, max_grad_norm -> grad_clip_norm); its
num_warmup_steps/scheduler are the caller's schedule of learning_rate (e.g. tx.sft).
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
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tx import ranks, types
from tx.backends.config import JaxBackendConfig, MixedPrecisionConfig, full_mode_lora_slots
from tx.backends.jax import JaxBackend
from tx.backends.steps import adamw
from tx.checkpoints import external, storage, training
from tx.checkpoints.full import (SAMPLER_FORMAT as FULL_SAMPLER_FORMAT, abstract_state, export_hf_model,
                                 load_full_checkpoint, read_full_metadata, save_full_checkpoint, save_sampler_model)
from tx.models.layers.lora import LoraA, LoraB
from tx.models.sharding import put_global, to_host

logger = logging.getLogger(__name__)

DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
FULL_ADAPTER = 0  # rows of the full model read LoRA slot 0, which stays zero: the plain (trained) weights


def is_base_param(_path, value) -> bool:
    """nnx filter: the trainable weights of full fine-tuning (every Param that is not a LoRA factor)."""
    return isinstance(value, nnx.Param) and not isinstance(value, (LoraA, LoraB))


def split_full(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, base weights, everything else)."""
    return nnx.split(model, is_base_param, ...)


def _all_finite(tree: Any) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
                              if jnp.issubdtype(x.dtype, jnp.floating)]))


@partial(jax.jit, donate_argnums=(0,))
def commit_grads(grad_sum: Any, acc: Any) -> tuple[Any, jax.Array]:
    """`grad_sum + acc` if all of it is finite, else `grad_sum` unchanged; `grad_sum` is donated (updated in
    place), the caller drops `acc` right after."""
    finite = _all_finite(jax.tree.map(jnp.add, grad_sum, acc))
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
        grad_norm = optax.tree.norm(grad_sum)
        clip = hp["grad_clip_norm"]
        clip_scale = jnp.where((clip > 0) & (grad_norm > clip), clip / jnp.maximum(grad_norm, 1e-30), 1.0)

        def update():
            clipped = jax.tree.map(lambda g: g * clip_scale, grad_sum)
            updates, new_state = adamw(hp).update(clipped, opt_state, master)
            return optax.apply_updates(master, updates), new_state, updates

        new_master, new_state, updates = update()
        metrics = {"grad_norm": grad_norm, "grad_clip_scale": clip_scale,
                   "update_norm": optax.tree.norm(updates), "param_norm": optax.tree.norm(new_master)}
        ok = _all_finite((new_master, new_state, metrics))

        def commit():
            m, s, _ = update()
            c = None if compute is None else jax.tree.map(lambda x: x.astype(param_dtype), m)
            return m, c, jax.tree.map(jnp.zeros_like, grad_sum), s

        master, compute, grad_sum, opt_state = jax.lax.cond(
            ok, commit, lambda: (master, compute, grad_sum, opt_state))
        return master, compute, grad_sum, opt_state, metrics, ok

    return jax.jit(step, donate_argnums=(0, 1, 2, 3))


def init_full_opt_state(master: nnx.State, mesh) -> optax.OptState:
    """Zero AdamW state: moments float32 and sharded like `master` (zeros_like keeps a committed array's
    sharding); the step count replicated on the mesh."""
    one = {k: 0.0 for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay")}
    state = adamw(one).init(master)

    def place(x):
        on_mesh = isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh
        return x if on_mesh else put_global(np.asarray(x), NamedSharding(mesh, P()))

    return jax.tree.map(place, state)


class FullBackend(JaxBackend):
    """The backend contract for full fine-tuning of one model at a time (see the module docstring)."""

    training_mode = "full"

    def __init__(self, base_model: str, config: JaxBackendConfig | None = None, run_id: str | None = None):
        config = config or JaxBackendConfig(training_mode="full")
        if config.training_mode == "full":
            # The config's validation already did this; a config copied into training_mode="full" (model_copy
            # skips validation) gets the full mode's LoRA slots here (a value the user gave is logged once).
            config = config.model_copy(update=full_mode_lora_slots(config) | {
                "mixed_precision": config.mixed_precision or MixedPrecisionConfig()})
        self.precision: MixedPrecisionConfig = config.mixed_precision or MixedPrecisionConfig()
        self.param_dtype = DTYPES[self.precision.param_dtype]
        super().__init__(base_model, config, run_id)
        self._grad_sum = None  # the live model's float32 gradient sums (no LoRA sums in this mode)
        self._master: nnx.State | None = None  # float32 masters when param_dtype is bf16
        self._opt_state: Any = None
        self.live: str | None = None
        self._weights_version = 0  # bumped whenever the live weights change: sampler saves name a version
        self._saved: OrderedDict[str, tuple[str, int, int]] = OrderedDict()  # path -> (model, version, step)

    _grad_dtype = jnp.float32  # reduce_dtype: every micro-batch's gradients leave the pass in float32

    def _load_base(self, dtype: str | None = None, **kw) -> nnx.Module:
        dtype = dtype or {"bf16": "bfloat16", "fp32": "float32"}[self.precision.param_dtype]
        return super()._load_base(dtype=dtype, experts_whole=False, **kw)

    def _split_trainable(self) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
        return split_full(self.model)

    def _slot(self, model_id: str) -> int:
        if model_id not in self.models:
            live = f"; the live model is {self.live!r}" if self.live else ""
            raise KeyError(f"unknown model_id {model_id!r}{live}")
        return FULL_ADAPTER

    def kv_identity(self, slot: int, tenant: str = "") -> str | None:
        # the one live model's weights (its owner's alone), or the base model's before one is created
        return f"full:{self._weights_version}" + (f":{tenant}" if tenant else "")

    def sample_slot(self, model_id: str) -> int:
        if not model_id:
            owner = f" by model {self.live!r}" if self.live else ""
            raise ValueError(f"training_mode='full': the base model (model id '') cannot be sampled, its weights "
                             f"are trained{owner}; sample with the model's id")
        return self._slot(model_id)

    # ---- the model ----

    def create_model(self, model_id: str, lora_config: types.LoraConfig) -> None:
        if self.live is not None:
            raise ValueError(f"training_mode='full' trains one model at a time: model {self.live!r} is live; "
                             f"delete it before creating {model_id!r}")
        _, params, _ = split_full(self.model)
        master = None
        if self.param_dtype != jnp.float32:  # float32 masters read from the checkpoint, not cast up from bf16
            _, master, _ = split_full(self._load_base(dtype="float32"))
        self._grad_sum = jax.tree.map(lambda x: jnp.zeros_like(x, dtype=jnp.float32), params)
        self._opt_state = init_full_opt_state(params if master is None else master, self.mesh)
        self._master = master
        self.live = model_id
        self.models[model_id] = types.ModelMetadata(model_id=model_id, adapter_index=FULL_ADAPTER,
                                                    lora_config=lora_config)
        self._accumulated[model_id] = {"sequences": 0, "tokens": 0}
        logger.info("created full model %s (param_dtype %s; LoRA rank %d ignored)", model_id,
                    self.precision.param_dtype, lora_config.rank)

    def delete_model(self, model_id: str) -> None:
        """Drop the model's optimizer state and sums and restore the base weights, re-read from the checkpoint."""
        self._slot(model_id)
        self.sampler.before_weights_change(FULL_ADAPTER)
        self._grad_sum = self._master = self._opt_state = None
        del self.models[model_id], self._accumulated[model_id]
        self.live = None
        _, base, _ = split_full(self._load_base())
        nnx.update(self.model, base)
        self._weights_version += 1
        for key in [k for k, saved in self._saved.items() if saved[0] == model_id]:
            del self._saved[key]
        logger.info("deleted full model %s; base weights restored from %s", model_id, self.model_dir)

    def grad_sum_of(self, model_id: str) -> dict:
        """The model's float32 gradient sums, `{"dotted.path": array}` (for inspection)."""
        self._slot(model_id)
        return {".".join(map(str, path)): to_host(v.get_value()) for path, v in nnx.to_flat_state(self._grad_sum)}

    def opt_state_of(self, model_id: str) -> Any:
        self._slot(model_id)
        return self._opt_state

    def master_weights(self, model_id: str) -> nnx.State:
        """The optimizer's float32 weights: the masters (bf16 params) or the model's own weights (fp32)."""
        self._slot(model_id)
        return self._master if self._master is not None else split_full(self.model)[1]

    def state_bytes(self) -> dict[str, int]:
        """Bytes the training state holds on this process's first device, per kind (model weights, float32
        masters, gradient sums, Adam moments): with fsdp sharding, about the total / fsdp."""
        device = self.mesh.devices.flat[0]

        def on_device(tree) -> int:
            return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in getattr(x, "addressable_shards", [])
                       if s.device == device)

        return {"params": on_device(split_full(self.model)[1]), "masters": on_device(self._master),
                "grad_sums": on_device(self._grad_sum), "adam": on_device(self._opt_state)}

    # ---- gradients ----

    def _commit(self, batch, rows, by_request: dict[int, list[int]], failed: dict[int, str], acc) -> dict[int, str]:
        """All requests of a pass are the one model's: if any failed, none of the pass's gradients count."""
        model_id = self.live
        if failed:
            return {r: (f"another request of model {model_id!r} in the same pass failed with non-finite outputs; "
                        "this pass's gradients were dropped, retry this request") for r in by_request if r not in failed}
        self._grad_sum, finite = commit_grads(self._grad_sum, acc)
        if not bool(to_host(finite)):
            return {r: (f"the gradient sums of model {model_id!r} would not be finite in float32 after this pass; "
                        "this pass's gradients were dropped") for r in by_request}
        counts = self._accumulated[model_id]
        for members in by_request.values():
            counts["sequences"] += len(members)
            counts["tokens"] += sum(len(rows[i].input_ids) for i in members)
        return {}

    # ---- optimizer ----

    def optim_step(self, model_id: str, request_data: types.OptimStepInput) -> types.OptimStepOutput:
        self._slot(model_id)
        self.sampler.before_weights_change(FULL_ADAPTER)  # requests reading these weights finish first
        fn = self.runtime.program(("full_optim_step",), lambda: make_full_optim_step(self.param_dtype,
                                                                                      self.runtime.counted("optim_step")))
        hp = {k: jnp.float32(v) for k, v in request_data.adam_params.model_dump().items()}
        _, params, _ = split_full(self.model)
        master, compute = (params, None) if self._master is None else (self._master, params)
        master, compute, self._grad_sum, self._opt_state, metrics, ok = self.runtime.run(
            "optim_step", fn, master, compute, self._grad_sum, self._opt_state, hp)
        if self._master is None:
            nnx.update(self.model, master)
        else:
            self._master = master
            nnx.update(self.model, compute)
        if bool(to_host(ok)):  # a refused step leaves the weights (and their sampler saves) as they were
            self._weights_version += 1
        return self._finish_step(model_id, request_data, metrics, ok)

    # ---- checkpoints ----
    #
    # Training state: the float32 weights (masters, or the model's own in fp32), the AdamW state and the step,
    # with orbax (tx/checkpoints/full.py), restorable onto another mesh. Sampler weights: the weights the model
    # computes with, as an HF safetensors model (tar, or a marker with persist=False). There is one copy of the
    # weights, so a sampler path is served while the live weights are still the ones it saved (no optim_step
    # or load since); an older save is refused with a message, not silently served newer weights.

    def save_checkpoint(self, output_path, model_id: str) -> None:
        self._slot(model_id)
        meta = self.models[model_id]
        save_full_checkpoint(
            output_path, self.master_weights(model_id), self._opt_state, meta.optim_steps,
            {"base_model": self.base_model, "base": training.base_signature(self.model.config),
             "training_mode": "full", "param_dtype": self.precision.param_dtype,
             "lora_config": meta.lora_config.model_dump(), "saved_at": time.time()},
            version=self.unique_name())
        logger.info("saved full training checkpoint of %s (step %d) to %s", model_id, meta.optim_steps, output_path)

    def checkpoint_metadata(self, checkpoint_path) -> dict:
        return read_full_metadata(checkpoint_path)

    def load_checkpoint(self, checkpoint_path, model_id: str, load_optimizer: bool = True) -> None:
        """Restore weights (and the AdamW state unless `load_optimizer=False`) exactly, onto this mesh. The
        live state is kept until the whole checkpoint is read and validated, so a failed load changes
        nothing; the peak is therefore two copies of the float32 training state while it loads."""
        self._slot(model_id)
        ckpt = load_full_checkpoint(
            checkpoint_path, abstract_state(self.master_weights(model_id)),
            abstract_state(self._opt_state) if load_optimizer else None,
            expected_base=training.base_signature(self.model.config))
        self._set_weights(ckpt.params)
        self._opt_state = ckpt.opt_state if load_optimizer else init_full_opt_state(ckpt.params, self.mesh)
        self._grad_sum = jax.tree.map(jnp.zeros_like, self._grad_sum)
        self._reset_accumulation(model_id)
        self.models[model_id] = self.models[model_id].model_copy(update={
            "lora_config": types.LoraConfig(**ckpt.metadata["lora_config"]), "optim_steps": ckpt.step})
        logger.info("loaded %s into %s (step %d, optimizer: %s)", checkpoint_path, model_id, ckpt.step, load_optimizer)

    def _set_weights(self, master: nnx.State) -> None:
        """New float32 weights: the model's own (fp32), or the masters and their cast into the model (bf16)."""
        self.sampler.before_weights_change(FULL_ADAPTER)
        if self._master is None:
            nnx.update(self.model, master)
        else:
            self._master = master
            nnx.update(self.model, jax.tree.map(lambda m: m.astype(self.param_dtype), master))
        self._weights_version += 1

    def _export_info(self, model_id: str, **extra) -> dict:
        return {"model_id": model_id, "base_model": self.base_model, "base": training.base_signature(self.model.config),
                "optim_steps": self.models[model_id].optim_steps, "param_dtype": self.precision.param_dtype,
                "saved_at": time.time(), **extra}

    def save_sampler_checkpoint(self, output_path, model_id: str, persist: bool = True) -> None:
        """An HF safetensors model of the weights sampling uses (a tar at `output_path`), or with
        persist=False a marker; either way `output_path` samples the live weights until they change."""
        self._slot(model_id)
        info = self._export_info(model_id, persisted=persist)
        if persist:
            save_sampler_model(output_path, self.model, self.model_dir, info)
        elif ranks.is_primary_writer():
            with tempfile.TemporaryDirectory() as tmp:
                marker = Path(tmp) / "marker.json"
                marker.write_text(json.dumps({"format": FULL_SAMPLER_FORMAT, **info}))
                storage.write_file_atomic(output_path, marker)
        key = str(output_path)
        self._saved.pop(key, None)
        self._saved[key] = (model_id, self._weights_version, info["optim_steps"])
        while len(self._saved) > 4096:
            self._saved.popitem(last=False)

    def evict_sampler_checkpoint(self, path) -> None:
        self._saved.pop(str(path), None)

    def sampler_slot(self, path: str, pinned: set[int]) -> int:
        saved = self._saved.get(path)
        if saved is None:
            raise ValueError(f"sampler checkpoint {path}: training_mode='full' samples only the live model's "
                             "latest saved weights, and this is not a save of them; to sample an exported model, "
                             "serve its directory with `python -m tx.run --base-model <dir>`")
        model_id, version, step = saved
        if model_id != self.live or version != self._weights_version:
            now = f"now at step {self.models[self.live].optim_steps}" if self.live else "since deleted"
            raise ValueError(f"sampler checkpoint {path} holds model {model_id!r}'s weights of step {step}, which "
                             f"have changed since ({now}); training_mode='full' keeps one copy of the weights, so "
                             "only a save made after the last optim_step or load can be sampled: save the weights "
                             "for the sampler again")
        return FULL_ADAPTER

    def save_external_weights(self, output_path, model_id: str, age_recipients: list[str] | None = None) -> None:
        """The model as an HF safetensors directory at `output_path`, each file age-encrypted to
        `age_recipients` when given. Every process gathers, process 0 writes."""
        self._slot(model_id)
        external.parse_recipients(age_recipients)  # on every process: refused before any collective gather
        with tempfile.TemporaryDirectory() as tmp:
            hf = Path(tmp) / "model"
            export_hf_model(hf, self.model, self.model_dir)
            if not ranks.is_primary_writer():
                return
            (hf / "tx_metadata.json").write_text(json.dumps(self._export_info(model_id), indent=2))
            external.publish_dir(hf, output_path, age_recipients)
        logger.info("saved external weights (HF model) of %s to %s", model_id, output_path)


def backend_class(config: JaxBackendConfig) -> type[JaxBackend]:
    """The backend class that serves `config.training_mode`."""
    return FullBackend if config.training_mode == "full" else JaxBackend
