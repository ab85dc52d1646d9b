"""The LoRA state's checkpoints: training state (orbax) and sampler weights (PEFT tarballs, in-memory
snapshots), each of one adapter slot of the backend's model.

Mixed into `LoraSlotsState` (tx/backends/lora_state.py) only, to keep that module to the slot table, the
gradient sums and the optimizer; the methods here add to it, they override nothing.
"""

from __future__ import annotations

import json
import logging
import tarfile
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tx import ranks, types
from tx.backends.steps import init_opt_state, put_slot, take_slot
from tx.checkpoints import external, peft_format, storage, training
from tx.models.adapters import plan_adapter_weights, write_adapter_slot
from tx.models.layers.lora import LoraA, LoraB, LoraScale

logger = logging.getLogger(__name__)
SAMPLER_FORMAT = "tx-sampler-checkpoint-v1"


@dataclass
class Snapshot:
    """Weights saved for sampling, kept in memory. `copy` is None while the model's slot still holds them;
    else (LoRA factors, scales) of one slot, copied just before the model changed them."""

    model_id: str
    persisted: bool
    copy: tuple[Any, Any] | None = None


def _split(model) -> tuple[nnx.GraphDef, nnx.State, nnx.State, nnx.State]:
    return nnx.split(model, (LoraA, LoraB), LoraScale, ...)


def _take_scales(scales: nnx.State, slot: int) -> Any:
    return jax.tree.map(lambda x: x[..., slot], scales)


def _put_scales(scales: nnx.State, values: Any, slot: int) -> Any:
    return jax.tree.map(lambda x, v: x.at[..., slot].set(v), scales, values)


class CheckpointMixin:
    """Needs (from LoraSlotsState): host (the backend), slots, opt_states, slot(model_id)."""

    host: Any
    slots: Any
    opt_states: dict[str, Any]
    snapshots: OrderedDict[str, Snapshot]
    _evicted: OrderedDict[str, str]

    # ---- training state ----

    def save_checkpoint(self, output_path, model_id: str) -> None:
        slot = self.slot(model_id)
        meta = self.host.models[model_id]
        _, lora, scales, _ = _split(self.host.model)
        training.save(
            output_path,
            weights=take_slot(lora, jnp.int32(slot)),
            scales=_take_scales(scales, slot),
            opt_state=self.opt_states[model_id],
            rank=meta.lora_config.rank,
            version=self.host.unique_name(),
            metadata={
                "base_model": self.host.base_model,
                "base": training.base_signature(self.host.model.config),
                "lora_config": meta.lora_config.model_dump(),
                "optim_steps": meta.optim_steps,
                "saved_at": time.time(),
            },
        )
        logger.info("saved training checkpoint of %s to %s", model_id, output_path)

    def checkpoint_metadata(self, checkpoint_path) -> dict:
        """Metadata of a training checkpoint (its LoraConfig lets an engine recreate the model first)."""
        return training.read_metadata(checkpoint_path)

    def load_checkpoint(self, checkpoint_path, model_id: str, load_optimizer: bool = True) -> dict:
        slot = self.slot(model_id)
        meta = training.read_metadata(checkpoint_path)
        current = training.base_signature(self.host.model.config)
        if meta.get("base") != current:
            raise training.CheckpointError(
                f"checkpoint at {checkpoint_path} was saved for base model {meta.get('base_model')!r} "
                f"({meta.get('base')}), this backend serves {self.host.base_model!r} ({current})"
            )
        rank = self.host.models[model_id].lora_config.rank
        if meta["rank"] != rank:
            raise training.CheckpointError(
                f"checkpoint at {checkpoint_path} has LoRA rank {meta['rank']}, model {model_id!r} has rank {rank}"
            )
        _, lora, scales, _ = _split(self.host.model)
        _, weights, new_scales, opt_state = training.load(
            checkpoint_path,
            weights=take_slot(lora, jnp.int32(slot)),
            scales=_take_scales(scales, slot),
            opt_state=self.opt_states[model_id],
            mesh=self.host.mesh,
            load_optimizer=load_optimizer,
        )
        # Everything is read and validated: now change state.
        self.before_slot_change(model_id)
        nnx.update(self.host.model, put_slot(lora, weights, jnp.int32(slot)), _put_scales(scales, new_scales, slot))
        self.opt_states[model_id] = opt_state if load_optimizer else init_opt_state(
            _split(self.host.model)[1], slot, self.host.mesh)
        logger.info("loaded %s into %s (optimizer: %s)", checkpoint_path, model_id, load_optimizer)
        return {"lora_config": types.LoraConfig(**meta["lora_config"]), "optim_steps": meta.get("optim_steps", 0)}

    def save_external_weights(self, output_path, model_id: str, age_recipients: list[str] | None = None) -> None:
        """The adapter as a PEFT directory at `output_path` (versioned like a training checkpoint), each file
        age-encrypted to `age_recipients` when given. Every process computes, process 0 writes."""
        slot = self.slot(model_id)
        lora = self.host.models[model_id].lora_config
        if not ranks.is_primary_writer():
            peft_format.get_adapter_weights(self.host.model, slot, lora.rank)  # the same collectives
            return
        external.parse_recipients(age_recipients)  # refused before anything is written
        with tempfile.TemporaryDirectory() as tmp:
            adapter = Path(tmp) / "adapter"
            peft_format.export_adapter(self.host.model, slot, lora.rank, lora.alpha, self.host.base_model, adapter)
            external.publish_dir(adapter, output_path, age_recipients)
        logger.info("saved external weights of %s to %s", model_id, output_path)

    # ---- sampler weights ----
    #
    # A save keeps a Snapshot of the model's weights for sampling. While the model's slot still holds them,
    # the snapshot is served from that slot (no memory, no spare slot: RL with ephemeral sampling clients
    # works with every slot held by training models). Just before the slot changes (optim_step, load,
    # unload) an in-memory (persist=False) snapshot copies its slot once (shared by the snapshots of that
    # version); a persisted one is dropped and re-read from its file when sampled again.

    def slot_changed(self, slot: int) -> None:
        """The weights of `slot` change: requests sampling from it finish first, and KV computed with the
        old weights is not reused (prefix cache)."""
        self.host.sampler.before_weights_change(slot)
        self._slot_epochs[slot] = self._slot_epochs.get(slot, 0) + 1

    def kv_identity(self, slot: int, tenant: str = "") -> str | None:
        """Names the weights rows of `slot` are computed with now, and whose rows may share KV pages (the
        prefix cache keys pages by it). A live model's adapter is its owner's; the base model and sampler
        checkpoints are shared by tenants, and a cache hit there would tell one tenant what another sent, so
        their rows share pages only with requests of the same `tenant`, and with none when it is ""."""
        weights = f"{slot}:{self._slot_epochs.get(slot, 0)}"
        if slot in {m.adapter_index for m in self.host.models.values()}:
            return f"lora:{weights}" + (f":{tenant}" if tenant else "")
        return f"shared:{weights}:{tenant}" if tenant else None

    def holds_snapshot(self, path: str) -> bool:
        """Whether sampler checkpoint `path` is held in memory (sampled without reading the disk)."""
        return path in self.snapshots

    def init_snapshots(self) -> None:
        self._slot_epochs: dict[int, int] = {}
        self.snapshots: OrderedDict[str, Snapshot] = OrderedDict()
        self._evicted: OrderedDict[str, str] = OrderedDict()  # in-memory snapshot -> why it is gone

    def save_sampler_checkpoint(self, output_path, model_id: str, persist: bool = True) -> None:
        """PEFT tarball at `output_path` (persist) or a small marker (persist=False); in both cases a
        snapshot of the weights stays in memory for sampling."""
        slot = self.slot(model_id)
        meta = self.host.models[model_id]
        key = str(output_path)
        info = {"format": SAMPLER_FORMAT, "model_id": model_id, "persisted": persist, "base_model": self.host.base_model,
                "base": training.base_signature(self.host.model.config), "rank": meta.lora_config.rank,
                "saved_at": time.time()}
        primary = ranks.is_primary_writer()  # every process computes, one writes (tx.ranks)
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            if not primary:
                if persist:
                    peft_format.get_adapter_weights(self.host.model, slot, meta.lora_config.rank)  # same collectives
            elif persist:
                adapter = tmp / "adapter"
                peft_format.export_adapter(self.host.model, slot, meta.lora_config.rank, meta.lora_config.alpha,
                                           self.host.base_model, adapter)
                (adapter / "tx_metadata.json").write_text(json.dumps(info, indent=2))
                storage.pack_tar(adapter, tmp / "out.tar.gz")
                storage.write_file_atomic(output_path, tmp / "out.tar.gz")
            else:
                (tmp / "marker.json").write_text(json.dumps(info))
                storage.write_file_atomic(output_path, tmp / "marker.json")
        self.slots.forget(key)  # an older version of this path may be cached in a slot
        self.snapshots.pop(key, None)
        self._evicted.pop(key, None)
        self.snapshots[key] = Snapshot(model_id, persist)
        cap = self.host.config.max_snapshots_per_model
        mine = [k for k, snap in self.snapshots.items() if snap.model_id == model_id and not snap.persisted]
        for old in mine[: max(0, len(mine) - cap)]:
            self._drop_snapshot(old, f"evicted: model {model_id} keeps at most {cap} in-memory sampler "
                                     f"snapshots (max_snapshots_per_model={cap}); save a newer one")

    def _drop_snapshot(self, key: str, reason: str) -> None:
        snap = self.snapshots.pop(key, None)
        self.slots.forget(key)
        if snap is not None and not snap.persisted:
            self._evicted[key] = reason
            while len(self._evicted) > 4096:
                self._evicted.popitem(last=False)

    def before_slot_change(self, model_id: str, unloading: bool = False) -> None:
        """The weights of `model_id`'s slot are about to change: its snapshots stop being served from it."""
        self.slot_changed(self.slot(model_id))
        copy = None
        for key, snap in list(self.snapshots.items()):
            if snap.model_id != model_id:
                continue
            if unloading and not snap.persisted:
                self._drop_snapshot(key, f"released: model {model_id} was unloaded")
            elif snap.copy is None and snap.persisted:
                del self.snapshots[key]  # its file has the weights
            elif snap.copy is None:
                if copy is None:
                    slot = self.slot(model_id)
                    _, lora, scales, _ = _split(self.host.model)
                    copy = (take_slot(lora, jnp.int32(slot)), _take_scales(scales, slot))
                snap.copy = copy

    def evict_sampler_checkpoint(self, path) -> None:
        """Forget sampler checkpoint `path` (its files were deleted): no slot or snapshot serves it any more."""
        key = str(path)
        self._drop_snapshot(key, "deleted")
        self._evicted.pop(key, None)

    def sampler_slot(self, path: str, pinned: set[int]) -> int:
        """The slot holding sampler checkpoint `path`: the saving model's own slot while it still holds those
        weights, else a spare slot the checkpoint is loaded into. Loading is all-or-nothing: everything is
        read and validated before the slot is taken, and a failed write frees the slot again."""
        snap = self.snapshots.get(path)
        if snap is not None and snap.copy is None:
            return self.slot(snap.model_id)
        slot = self.slots.cached(path)
        if slot is not None:
            return slot
        if snap is not None:
            def write(slot: int) -> None:
                _, lora, scales, _ = _split(self.host.model)
                nnx.update(self.host.model, put_slot(lora, snap.copy[0], jnp.int32(slot)),
                           _put_scales(scales, snap.copy[1], slot))
        else:
            if path in self._evicted:
                raise storage.CheckpointNotFound(f"sampler snapshot {path} is no longer in memory: it was "
                                                 f"{self._evicted[path]}")
            weights, rank, alpha = self._read_sampler_checkpoint(path)
            try:
                plan = plan_adapter_weights(self.host.model, weights, alpha=alpha, rank=rank)
            except ValueError as e:
                raise ValueError(f"sampler checkpoint {path} does not fit this model: {e}") from None

            def write(slot: int) -> None:
                write_adapter_slot(plan, slot)

        slot = self.slots.lend(path, pinned)
        if slot is None:
            raise ValueError(f"no free adapter slot to load sampler checkpoint {path}: all "
                             f"{self.slots.num_slots - 1} slots hold models or checkpoints this call samples")
        try:
            self.slot_changed(slot)
            write(slot)
        except BaseException:
            self.slots.forget(path)  # never leave a slot marked as holding a half-written checkpoint
            raise
        logger.info("sampler checkpoint %s loaded into slot %d", path, slot)
        return slot

    def _read_sampler_checkpoint(self, path: str):
        with storage.read_file(path) as local, tempfile.TemporaryDirectory() as tmp:
            try:
                marker = json.loads(local.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError):
                marker = None
            if marker is not None:
                raise storage.CheckpointNotFound(
                    f"sampler checkpoint {path} was saved with persist=False and is no longer in memory")
            try:
                storage.unpack_tar(local, Path(tmp))
            except (tarfile.TarError, OSError, EOFError) as e:
                raise ValueError(f"sampler checkpoint {path} is not a readable tar.gz: {e}") from None
            self.host.metrics.calls["load_sampler_checkpoint"] = self.host.metrics.calls.get("load_sampler_checkpoint", 0) + 1
            return peft_format.import_adapter(self.host.model, Path(tmp), self.host.config.max_lora_rank)
