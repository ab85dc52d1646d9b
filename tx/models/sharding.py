"""Parameter sharding and the mesh: each parameter's logical axes (`tx.models.logical`), and mesh sizing.

Logical axes of every parameter, per layer (a scanned stack adds a leading "layers" axis):
- every linear is listed once in `LINEAR_AXES` as (in-features axis, out-features axis): with the default
  rules Megatron-style column-parallel then row-parallel over "tp" ("heads", "kv_heads", "mlp", "vocab"),
  and the model width ("embed") over "fsdp" (ZeRO-3 via GSPMD);
- its LoRA factors follow it: `lora_a [A, in, R]` names `in` like the kernel, `lora_b [A, R, out]` names
  `out` like the kernel, the adapter and rank axes are "adapter" and "rank"; `lora_scale [A]` is "adapter";
- MoE experts (`[E, ...]`) add a leading "expert" axis (default: "ep");
- the batch is "batch" (`batch_spec`: "fsdp").

The rules table that turns names into mesh axes is `JaxBackendConfig.logical_axis_rules` (default
`tx.models.logical.DEFAULT_RULES`). The mesh's sizes come from `resolve_mesh_shape` (one size may be -1:
the devices the others leave), which every caller that sizes a mesh uses.

Fallbacks (logged once): attention heads are replicated unless both num_attention_heads and
num_key_value_heads divide their mesh axis (or `shard_attention_heads=False`); any other dimension that
does not divide by its mesh axis is replicated along it.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tx.models.config import ModelConfig
from tx.models.logical import DEFAULT_RULES, LINEAR_AXES, MESH_AXES, LogicalSharding, Rules

# (module, variable) -> logical axes, for everything that is not a LoRA-carrying linear
OTHER_AXES: dict[tuple[str, str], tuple[str | None, ...]] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("gate", "kernel"): (None, None),  # MoE router [d, experts], small and read by every token: replicated
    ("gate", "e_score_correction_bias"): (None,),  # DeepSeek-V3's expert-selection bias [experts], as the router
    ("lm_head", "value_head"): ("adapter", None, None),  # [A, d, 1]: tiny
}


AUTO = -1  # a mesh size of -1 ("auto" in a flag or JSON): the devices the other two axes leave
# mesh axis -> the JaxBackendConfig field that sizes it (callers with their own names pass `names`)
MESH_FIELDS = {"fsdp": "fully_sharded_data_parallel_size", "ep": "expert_parallel_size", "tp": "tensor_parallel_size"}


@dataclass(frozen=True)
class MeshShape:
    """A resolved (fsdp, ep, tp) mesh shape and the devices of the run it was resolved against."""

    fsdp: int
    ep: int
    tp: int
    num_devices: int

    @property
    def size(self) -> int:
        return self.fsdp * self.ep * self.tp

    @property
    def idle(self) -> int:
        """Devices of the run the mesh leaves out."""
        return self.num_devices - self.size


def resolve_mesh_shape(fsdp: int, ep: int, tp: int, num_devices: int, num_processes: int = 1,
                       names: Mapping[str, str] = MESH_FIELDS) -> MeshShape:
    """The (fsdp, ep, tp) sizes over `num_devices` devices (all devices of all `num_processes` processes).

    At most one size may be -1 (`AUTO`): it gets the devices the other two leave, which must divide
    `num_devices`. With no -1, the product must divide `num_devices`; a smaller mesh leaves devices idle
    (the caller says so), which a multi-process run refuses: its mesh must span every process. Errors name
    the fields (`names`: axis -> field name, e.g. a trainer's own spelling) and their values."""
    sizes = {"fsdp": fsdp, "ep": ep, "tp": tp}
    given = ", ".join(f"{names[a]}={v}" for a, v in sizes.items())
    for axis, value in sizes.items():
        if value < 1 and value != AUTO:
            raise ValueError(f"{names[axis]}={value}: a mesh size is >= 1, or -1 (auto: the devices the other "
                             "axes leave)")
    auto = [a for a, v in sizes.items() if v == AUTO]
    if len(auto) > 1:
        raise ValueError(f"{' and '.join(f'{names[a]}=-1' for a in auto)}: at most one mesh size may be -1 (auto)")
    fixed = math.prod(v for v in sizes.values() if v != AUTO)
    if fixed > num_devices:
        raise ValueError(f"{given}: {'the sizes other than -1 need' if auto else 'the mesh needs'} {fixed} devices; "
                         f"the run has {num_devices}")
    if num_devices % fixed:
        if auto:
            raise ValueError(f"{given}: the sizes other than -1 multiply to {fixed}, which does not divide the "
                             f"{num_devices} devices of the run, so {names[auto[0]]}=-1 (auto) has no size")
        raise ValueError(f"{given}: their product {fixed} does not divide the {num_devices} devices of the run")
    if auto:
        sizes[auto[0]] = num_devices // fixed
    elif num_processes > 1 and fixed != num_devices:
        raise ValueError(f"{given}: a multi-process mesh must cover all {num_devices} devices of the {num_processes} "
                         f"processes, this one covers {fixed}")
    return MeshShape(**sizes, num_devices=num_devices)


def describe_mesh(mesh: Mesh, num_devices: int | None = None, num_processes: int = 1) -> str:
    """E.g. `fsdp=8 ep=1 tp=1 over 8 devices (cpu x8) on 1 process` (`over 4 of 8 devices` when the run has
    `num_devices` and the mesh leaves some idle): the startup log's account of the mesh."""
    kinds = Counter(d.device_kind for d in mesh.devices.flat)
    axes = " ".join(f"{a}={mesh.shape[a]}" for a in MESH_AXES)
    of = f" of {num_devices}" if num_devices not in (None, mesh.devices.size) else ""
    devices = ", ".join(f"{kind} x{n}" for kind, n in kinds.items())
    return (f"{axes} over {mesh.devices.size}{of} devices ({devices}) on {num_processes} "
            f"process{'es' if num_processes > 1 else ''}")


def make_mesh(fsdp: int = 1, ep: int = 1, tp: int = 1, devices: list | None = None) -> Mesh:
    """A (fsdp, ep, tp) mesh over `devices` (default: all devices, so it spans every host)."""
    devices = list(jax.devices() if devices is None else devices)
    if fsdp * ep * tp != len(devices):
        raise ValueError(f"mesh fsdp={fsdp} x ep={ep} x tp={tp} = {fsdp * ep * tp} != {len(devices)} devices")
    return Mesh(np.asarray(devices).reshape(fsdp, ep, tp), MESH_AXES)


def batch_spec(ndim: int) -> P:
    """Inputs: batch over fsdp, everything else replicated."""
    return P("fsdp", *([None] * (ndim - 1)))


def logical_axes(path: tuple[str, ...]) -> tuple[str | None, ...]:
    """Logical axes of one layer's variable (without the leading "layers" axis), from its nnx path."""
    module, leaf = path[-2], path[-1]
    if module in LINEAR_AXES and leaf in ("kernel", "lora_a", "lora_b", "lora_scale"):
        i, o = LINEAR_AXES[module]
        axes = {"kernel": (i, o), "lora_a": ("adapter", i, "rank"), "lora_b": ("adapter", "rank", o),
                "lora_scale": ("adapter",)}[leaf]
        if "experts" in path and leaf != "lora_scale":
            axes = ("expert", *axes)
        return axes
    if (module, leaf) in OTHER_AXES:
        return OTHER_AXES[(module, leaf)]
    if leaf == "weight":  # RMSNorm scales
        return (None,)
    raise KeyError(f"no sharding rule for parameter {'.'.join(path)}")


def logical_sharding(mesh: Mesh | None, cfg: ModelConfig, shard_attention_heads: bool = True,
                     rules: Rules = DEFAULT_RULES) -> LogicalSharding:
    """The rules table bound to `mesh` for the model of `cfg` (its head counts decide head splitting)."""
    return LogicalSharding(mesh, tuple(rules), (cfg.num_attention_heads, cfg.num_key_value_heads),
                           shard_attention_heads)


def param_spec(
    path: tuple[Any, ...], shape: tuple[int, ...], mesh: Mesh, cfg: ModelConfig, shard_attention_heads: bool = True,
    rules: Rules = DEFAULT_RULES,
) -> P:
    """The `PartitionSpec` of the variable at nnx `path` with global `shape` on `mesh`."""
    names = tuple(str(p) for p in path)
    axes = logical_axes(names)
    axes = ("layers",) * (len(shape) - len(axes)) + axes  # leading stacked-layer axis
    return logical_sharding(mesh, cfg, shard_attention_heads, rules).spec(axes, shape, ".".join(names))


def param_sharding(path, shape, mesh: Mesh, cfg: ModelConfig, shard_attention_heads: bool = True,
                   rules: Rules = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, param_spec(path, shape, mesh, cfg, shard_attention_heads, rules))


def zeros_global(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> jax.Array:
    """A zero-filled global array that XLA makes on each device (each process its own shards). Not `put_global`
    of `np.zeros`: jax on CPU wraps a 64-byte-aligned host array without copying (where numpy's buffer lands
    depends on the heap's history), and a wrapped buffer cannot be donated, so the first call that donates it
    copies it whole."""
    return _zeros_program(tuple(shape), np.dtype(dtype), sharding)()


@functools.cache
def _zeros_program(shape: tuple[int, ...], dtype: np.dtype, sharding: NamedSharding) -> Any:
    import jax.numpy as jnp

    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


def put_global(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array every process holds in full (each process fills its own shards);
    works the same in one process and across hosts."""
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index], dtype=array.dtype)


def to_host(x: jax.Array) -> np.ndarray:
    """The full value of a global array on this host (gathering across processes when needed)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def min_over_processes(value: int) -> int:
    """The smallest of every process's `value`, on every process (a collective: each process calls it at the
    same point of the program); `value` itself in a one-process run. For sizes every host must agree on."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.asarray([value], np.int32))))
