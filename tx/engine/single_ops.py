"""The engine's single ops (create, load, save, optim_step, unload): each `_do_<kind>(op)` runs on the engine
thread and returns (its JSON result, [updates to the model's row]); `Engine._run_single` writes both."""

from __future__ import annotations

import time

from tx import types
from tx.checkpoints import storage
from tx.engine import paths
from tx.engine.ops import LoadRequest, Op, SaveRequest, UserError
from tx.engine.results import error_payload, finite_metrics


class SingleOpsMixin:
    """Engine methods for the ops that run one at a time (`self.backends`, `self._base_of`, `self.store`,
    `self.scheduler` are the engine's)."""

    def _served(self, base: str):
        if base not in self.backends:
            raise UserError(f"base_model {base!r} is not served here; served: {', '.join(self.backends)}")
        return self.backends[base]

    def _created_on(self, op: Op):
        """The backend of the base model a create op names; the model's later ops are routed there."""
        base = op.payload.base_model or self.base_model
        backend = self._served(base)
        if base != self.base_model:
            self._base_of[op.model_id] = base
        return backend

    def _do_create_model(self, op: Op):
        backend = self._created_on(op)
        try:
            backend.create_model(op.model_id, op.payload.lora_config)
        except BaseException:
            self._base_of.pop(op.model_id, None)
            raise
        return {"model_id": op.model_id, "type": "create_model"}, [{"status": "ready"}]

    def _do_create_from_state(self, op: Op):
        backend = self._created_on(op)
        try:
            meta = backend.checkpoint_metadata(op.payload.location)
            lora_config = types.LoraConfig(**meta["lora_config"])
            backend.create_model(op.model_id, lora_config)
        except BaseException:
            self._base_of.pop(op.model_id, None)
            raise
        try:
            backend.load_checkpoint(op.payload.location, op.model_id, load_optimizer=op.payload.optimizer)
        except Exception:
            backend.delete_model(op.model_id)
            self._base_of.pop(op.model_id, None)
            raise
        return ({"model_id": op.model_id, "type": "load_weights"},
                [{"status": "ready", "lora_config": lora_config.model_dump()}])

    def _do_optim_step(self, op: Op):
        out = self._backend_of(op.model_id).optim_step(op.model_id, types.OptimStepInput(adam_params=op.payload))
        return {"metrics": finite_metrics(out.metrics)}, [{}]

    def _do_save_weights(self, op: Op):
        request: SaveRequest = op.payload
        where = paths.location(self.config.checkpoint_root, op.model_id, "weights", request.name)
        self._backend_of(op.model_id).save_checkpoint(where, op.model_id)
        self._record_checkpoint(op.model_id, "weights", request, where)
        return {"path": paths.tinker_path(op.model_id, "weights", request.name), "type": "save_weights"}, [{}]

    def _do_save_weights_for_sampler(self, op: Op):
        request: SaveRequest = op.payload
        if request.name is None:  # an in-memory snapshot served by a new sampling session
            where = paths.location(self.config.checkpoint_root, op.model_id, "sampler_weights",
                                   f"ephemeral-{op.request_id}")
            self._backend_of(op.model_id).save_sampler_checkpoint(where, op.model_id, persist=False)
            self.store.add_sampling_session(request.sampling_session_id, op.session_id,
                                            self._base_of.get(op.model_id, self.base_model), None, where)
            return {"sampling_session_id": request.sampling_session_id, "type": "save_weights_for_sampler"}, [{}]
        where = paths.location(self.config.checkpoint_root, op.model_id, "sampler_weights", request.name)
        self._backend_of(op.model_id).save_sampler_checkpoint(where, op.model_id, persist=True)
        self._record_checkpoint(op.model_id, "sampler_weights", request, where)
        return {"path": paths.tinker_path(op.model_id, "sampler_weights", request.name),
                "type": "save_weights_for_sampler"}, [{}]

    def _do_save_weights_external(self, op: Op):
        request: SaveRequest = op.payload
        where = paths.location(self.config.checkpoint_root, op.model_id, "external_weights", request.name)
        self._backend_of(op.model_id).save_external_weights(where, op.model_id, request.age_recipients or None)
        self._record_checkpoint(op.model_id, "external_weights", request, where)
        return {"path": paths.tinker_path(op.model_id, "external_weights", request.name), "size_bytes": _size_of(where),
                "type": "save_weights_external"}, [{}]

    def _record_checkpoint(self, model_id: str, kind: str, request: SaveRequest, where: str) -> None:
        expires = time.time() + request.ttl_seconds if request.ttl_seconds else None
        self.store.put_checkpoint(model_id, kind, request.name, where, expires, _size_of(where), request.user_metadata)

    def _do_rejected(self, op: Op):
        raise UserError(op.payload)  # refused at submit; it still took its place in the model's order

    def _do_load_weights(self, op: Op):
        request: LoadRequest = op.payload
        self._backend_of(op.model_id).load_checkpoint(request.location, op.model_id, load_optimizer=request.optimizer)
        return {"model_id": op.model_id, "type": "load_weights"}, [{}]

    def _do_unload_model(self, op: Op):
        with self.cond:
            dropped = self.scheduler.drop_model(op.model_id)
        self._finish([(d.request_id, "failed", error_payload(f"model {op.model_id} was unloaded", "user"))
                      for d in dropped])
        backend = self._backend_of(op.model_id)
        if backend.has_model(op.model_id):
            backend.delete_model(op.model_id)
        self._base_of.pop(op.model_id, None)
        return {"model_id": op.model_id, "type": "unload_model"}, [{"status": "unloaded"}]


def _size_of(where: str) -> int | None:
    path = storage.as_path(where)
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return path.stat().st_size
    except (OSError, AttributeError):
        return None
