"""A trainer config's mesh: `fsdp_size`, `ep_size`, `tp_size` (shared by tx.sft's config and tx.rl's `tx:` section).

A size left None is the backend's default (fsdp -1: the devices ep x tp leave, so the mesh spans every device of
the run; ep and tp 1). One size may be -1 / "auto". Errors name this config's fields (with its `MESH_PREFIX`).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, Field, model_validator

from tx.backends.config import JaxBackendConfig, MeshSize
from tx.models.sharding import AUTO, MESH_FIELDS, MeshShape, resolve_mesh_shape

# mesh axis -> the trainer config's field that sizes it
TRAINER_MESH_FIELDS = {"fsdp": "fsdp_size", "ep": "ep_size", "tp": "tp_size"}


class MeshFields(BaseModel):
    MESH_PREFIX: ClassVar[str] = ""  # where the fields live in the user's config, for error messages

    fsdp_size: MeshSize | None = Field(
        None, description="devices the weights, gradient sums and Adam state are sharded over (the mesh's fsdp axis; "
        "batches are split over it too); -1 or 'auto': the devices ep_size x tp_size leave; default (None): the "
        "backend's, -1, so the mesh spans every device")
    ep_size: MeshSize | None = Field(None, description="the mesh's expert-parallel axis (MoE experts); -1 or 'auto': "
                                     "the devices the others leave; default (None): the backend's, 1")
    tp_size: MeshSize | None = Field(None, description="the mesh's tensor-parallel axis; -1 or 'auto': the devices "
                                     "the others leave; default (None): the backend's, 1")

    @model_validator(mode="after")
    def _one_auto(self):
        auto = [name for name, size in zip(self._names().values(), self._mesh_axes()) if size == AUTO]
        if len(auto) > 1:  # the rest is checked against the devices when the job starts (mesh_shape)
            raise ValueError(f"{' and '.join(f'{name}=-1' for name in auto)}: at most one mesh size may be -1 (auto); "
                             f"{self.MESH_PREFIX}fsdp_size is -1 unless given")
        return self

    def mesh_sizes(self) -> dict[str, int]:
        """The mesh sizes this config sets, by JaxBackendConfig field (a size left None: the backend's default)."""
        given = {MESH_FIELDS[axis]: getattr(self, name) for axis, name in TRAINER_MESH_FIELDS.items()}
        return {field: value for field, value in given.items() if value is not None}

    def mesh_shape(self, num_devices: int, num_processes: int = 1) -> MeshShape:
        """The mesh the backend will build over the run's devices; errors name this config's fields."""
        return resolve_mesh_shape(*self._mesh_axes(), num_devices=num_devices, num_processes=num_processes,
                                  names=self._names())

    def _names(self) -> dict[str, str]:
        return {axis: self.MESH_PREFIX + name for axis, name in TRAINER_MESH_FIELDS.items()}

    def _mesh_axes(self) -> list[int]:
        """(fsdp, ep, tp) as the backend gets them: this config's sizes, else the backend's defaults."""
        given = self.mesh_sizes()
        return [given.get(field, JaxBackendConfig.model_fields[field].default) for field in MESH_FIELDS.values()]
