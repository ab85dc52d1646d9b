"""DistributedBackend: the backend callers use. Each method runs on every host (SPMD); in a multi-host
run process 0 broadcasts it first and returns only when all hosts agree it succeeded (see control.py
for what happens when they do not)."""

from __future__ import annotations

import uuid
from typing import Any, Callable

from tx import losses, types
from tx.backends.base import AbstractBackend
from tx.backends.config import JaxBackendConfig
from tx.backends.full import backend_class
from tx.backends.jax import JaxBackend
from tx.distributed import checks
from tx.distributed.control import Coordinator
from tx.distributed.rpc import encode_kwargs

BROADCAST = ("create_model", "delete_model", "forward", "forward_backward", "forward_backward_planned", "optim_step",
             "sample", "sample_submit", "sample_step",
             "save_checkpoint", "load_checkpoint", "save_sampler_checkpoint", "evict_sampler_checkpoint", "debug_fail",
             "save_external_weights")


def method_of(name: str) -> Callable:
    return JaxBackend.__init__ if name == "__init__" else getattr(JaxBackend, name)


class DistributedBackend(AbstractBackend):
    def __init__(self, base_model: str, config: JaxBackendConfig | None = None,
                 coordinator: Coordinator | None = None, run_id: str | None = None, target: str = ""):
        """`target`: the name workers know this backend by when a server holds several base models
        ("" for the first); every broadcast call carries it."""
        self.coordinator = coordinator
        self.target = target
        self.impl: JaxBackend | None = None
        if coordinator is not None:
            for pid, worker in coordinator.workers.items():
                theirs = tuple(worker.hello.get("losses", ()))
                if theirs != losses.names():
                    raise RuntimeError(f"loss registry differs on process {pid}: {theirs} vs {losses.names()} on "
                                       "process 0; import the module that registers custom losses on every host")
        self._call("__init__", base_model=base_model, config=config or JaxBackendConfig(),
                   run_id=run_id or uuid.uuid4().hex[:8])

    def _local(self, method: str, kwargs: dict) -> Any:
        if method == "__init__":
            self.impl = backend_class(kwargs["config"])(**kwargs)
            return None
        return getattr(self.impl, method)(**kwargs)

    def _call(self, method: str, **kwargs) -> Any:
        if self.coordinator is None:
            return self._local(method, kwargs)
        return self.coordinator.call(method, encode_kwargs(method_of(method), kwargs),
                                     run=lambda: self._local(method, kwargs),
                                     view=lambda: checks.view(method, self.impl, kwargs), target=self.target)

    # ---- broadcast methods ----

    def create_model(self, model_id: str, lora_config: types.LoraConfig) -> None:
        return self._call("create_model", model_id=model_id, lora_config=lora_config)

    def delete_model(self, model_id: str) -> None:
        return self._call("delete_model", model_id=model_id)

    def forward_backward(self, prepared_batch: types.PreparedModelPassBatch):
        return self._call("forward_backward", prepared_batch=prepared_batch)

    def forward_backward_planned(self, prepared_batch: types.PreparedModelPassBatch, plan: list[list[int]]):
        return self._call("forward_backward_planned", prepared_batch=prepared_batch, plan=plan)

    def forward(self, prepared_batch: types.PreparedModelPassBatch):
        return self._call("forward", prepared_batch=prepared_batch)

    def optim_step(self, model_id: str, request_data: types.OptimStepInput) -> types.OptimStepOutput:
        return self._call("optim_step", model_id=model_id, request_data=request_data)

    def sample(self, prepared_batch: types.PreparedSampleBatch):
        return self._call("sample", prepared_batch=prepared_batch)

    def sample_submit(self, prepared_batch: types.PreparedSampleBatch) -> dict[str, types.ErrorResponse]:
        return self._call("sample_submit", prepared_batch=prepared_batch)

    def sample_step(self) -> dict[str, types.SampleOutput]:
        return self._call("sample_step")

    def save_checkpoint(self, output_path, model_id: str) -> None:
        return self._call("save_checkpoint", output_path=output_path, model_id=model_id)

    def load_checkpoint(self, checkpoint_path, model_id: str, load_optimizer: bool = True) -> None:
        return self._call("load_checkpoint", checkpoint_path=checkpoint_path, model_id=model_id,
                          load_optimizer=load_optimizer)

    def save_sampler_checkpoint(self, output_path, model_id: str, persist: bool = True) -> None:
        return self._call("save_sampler_checkpoint", output_path=output_path, model_id=model_id, persist=persist)

    def save_external_weights(self, output_path, model_id: str, age_recipients: list[str] | None = None) -> None:
        return self._call("save_external_weights", output_path=output_path, model_id=model_id,
                          age_recipients=age_recipients)

    def evict_sampler_checkpoint(self, path: str) -> None:
        return self._call("evict_sampler_checkpoint", path=path)

    def debug_fail(self, message: str, process_ids: list[int], phase: str = "execute") -> None:
        """Fault injection for tests: raise `message` on `process_ids` while preparing or executing."""
        return self._call("debug_fail", message=message, process_ids=process_ids, phase=phase)

    # ---- local reads ----

    def has_model(self, model_id: str) -> bool:
        return self.impl.has_model(model_id)

    def checkpoint_metadata(self, checkpoint_path) -> dict:
        return self.impl.checkpoint_metadata(checkpoint_path)

    @property
    def models(self) -> dict[str, types.ModelMetadata]:
        return self.impl.models

    @property
    def sampling_active(self) -> bool:
        return self.impl.sampling_active

    @property
    def metrics(self) -> types.EngineMetrics:
        return self.impl.metrics

    def shutdown(self, reason: str | None = None) -> None:
        """Stop every worker (they exit their loop; non-zero with a `reason`) and close the control channel."""
        if self.coordinator is not None:
            self.coordinator.shutdown(reason=reason)
            self.coordinator = None
