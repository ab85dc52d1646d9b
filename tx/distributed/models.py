"""Several base models in one server: one backend per base model, all on the same devices and mesh.

The first (`--base-model`) serves requests that name no base model; each `--extra-base-model` gets a
backend of its own (its own adapter slots, gradient sums and compiled functions). Workers know each
backend by its name: every broadcast call carries it (`DistributedBackend.target`), so all hosts run a
call on the same model.
"""

from __future__ import annotations

import json
import logging

import jax
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tx.backends.config import JaxBackendConfig
from tx.backends.steps import split_model
from tx.distributed.backend import DistributedBackend
from tx.distributed.control import Coordinator
from tx.models.sharding import describe_mesh

logger = logging.getLogger(__name__)
MIB = 1 << 20


class BaseModels(BaseModel):
    """The base models one server holds, by the names clients send as `base_model`."""

    model_config = ConfigDict(extra="forbid")
    base_model: str = Field("tiny", description="the default base model: HF directory or hub id; 'tiny' = built-in")
    extra_base_models: list[str] = Field(default_factory=list, description="more base models served beside it")

    @field_validator("base_model", "extra_base_models")
    @classmethod
    def _not_blank(cls, value):
        for name in [value] if isinstance(value, str) else value:
            if not name.strip():
                raise ValueError(f"base model name {name!r} is blank")
        return value

    @model_validator(mode="after")
    def _distinct(self) -> BaseModels:
        seen: set[str] = set()
        for name in self.names():
            if name in seen:
                raise ValueError(f"base model {name!r} is given twice (--base-model / --extra-base-model)")
            seen.add(name)
        return self

    def names(self) -> list[str]:
        return [self.base_model, *self.extra_base_models]


def model_dir_of(name: str) -> str:
    """Where a base model name's weights are: the built-in tiny model's directory for 'tiny', else the name."""
    if name == "tiny":
        from tx.score import tiny_model_dir

        return str(tiny_model_dir())
    return name


def memory_report(impl) -> dict:
    """What one backend holds: base weights, LoRA factors of all slots and their gradient sums (global
    sizes, over all devices), and the devices' memory in use where the platform reports it."""
    _, lora, rest = split_model(impl.model)

    def mib(tree) -> float:
        return round(sum(x.nbytes for x in jax.tree.leaves(tree)) / MIB, 2)

    report = {"base_weights_mib": mib(rest), "lora_slots_mib": mib(lora), "grad_sums_mib": round(impl.grad_sum_bytes() / MIB, 2),
              "adapter_slots": impl.config.max_lora_adapters - 1}
    stats = [d.memory_stats() for d in jax.local_devices()]
    if all(stats):
        report["local_devices_in_use_mib"] = round(sum(s.get("bytes_in_use", 0) for s in stats) / MIB, 2)
    return report


def load_backends(models: BaseModels, config: JaxBackendConfig,
                  coordinator: Coordinator | None) -> dict[str, DistributedBackend]:
    """One backend per base model, in order (the first is the default), each logged with its mesh (shape,
    device kinds, processes) and memory."""
    backends: dict[str, DistributedBackend] = {}
    for i, name in enumerate(models.names()):
        backend = DistributedBackend(model_dir_of(name), config, coordinator, target="" if i == 0 else name)
        backends[name] = backend
        logger.info(json.dumps({"event": "base_model_loaded", "base_model": name, "default": i == 0,
                                "mesh": describe_mesh(backend.impl.mesh, jax.device_count(), jax.process_count()),
                                **memory_report(backend.impl)}))
    return backends
