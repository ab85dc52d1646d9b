"""Logical-axis sharding (MaxText's idea): tensors name their axes, one rules table maps names to mesh axes.

Parameters and the activations at block boundaries carry logical axis names (`LOGICAL_AXES`); the rules
table (`DEFAULT_RULES`, a backend config field) maps each name to a mesh axis of ("fsdp", "ep", "tp"), or
to nothing (replicated). A name may appear in several rules: the first whose mesh axis is not yet taken
by an earlier dimension of the same tensor wins. That is how one table serves weights and activations:
a weight `[embed, mlp]` puts `embed` on "fsdp" (ZeRO-3), while an activation `[batch, length, embed]` has
already given "fsdp" to `batch`, so its `embed` stays whole (the residual stream is replicated over "tp").

`LogicalSharding` binds a table to a mesh; layers call `constrain(x, names)` (a `with_sharding_constraint`)
at block boundaries and around attention and the MLP, so tensor-parallel layouts do not rest on GSPMD's
propagation alone. Without a mesh, or on one device, `constrain` is the identity.

Attention heads: "heads" and "kv_heads" go to their mesh axis only if both head counts divide its size
(the layers reshape `heads * head_dim` into heads, so a split head would cross devices); otherwise both are
replicated and that is logged once. Any other dimension that does not divide its mesh axis is replicated
along it (logged once per weight; silently for activations, whose batch may be a single decode row).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tx.log import warn_once

logger = logging.getLogger(__name__)

MESH_AXES = ("fsdp", "ep", "tp")
LOGICAL_AXES = (
    "batch",  # rows of a batch
    "length",  # tokens of a row
    "embed",  # the model width (hidden size)
    "mlp",  # the MLP / expert intermediate width
    "heads",  # query heads (of a q / o projection: heads x head_dim)
    "kv_heads",  # key/value heads
    "head_dim",
    "vocab",
    "expert",  # MoE experts
    "adapter",  # LoRA adapter slots
    "rank",  # LoRA rank
    "layers",  # the stacked-layer axis of a scanned stack
)
HEAD_AXES = ("heads", "kv_heads")
Rules = tuple[tuple[str, str | None], ...]

# module name -> logical (in-features axis, out-features axis) of every LoRA-carrying linear; its LoRA factors
# follow it: `lora_a [A, in, R]` -> ("adapter", in, "rank"), `lora_b [A, R, out]` -> ("adapter", "rank", out).
LINEAR_AXES: dict[str, tuple[str | None, str | None]] = {
    "q_proj": ("embed", "heads"),
    "k_proj": ("embed", "kv_heads"),
    "v_proj": ("embed", "kv_heads"),
    "o_proj": ("heads", "embed"),
    # DeepSeek-V3's latent attention: the low-rank bottlenecks stay whole (small), their up-projections split
    # by head like q_proj
    "q_a_proj": ("embed", None),
    "q_b_proj": (None, "heads"),
    "kv_a_proj_with_mqa": ("embed", None),
    "kv_b_proj": (None, "heads"),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
    "lm_head": ("embed", "vocab"),
}

# (logical axis, mesh axis or None); logical axes not listed are replicated.
DEFAULT_RULES: Rules = (
    ("batch", "fsdp"),
    ("embed", "fsdp"),
    ("mlp", "tp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("vocab", "tp"),
    ("expert", "ep"),
    ("length", None),
    ("head_dim", None),
    ("adapter", None),
    ("rank", None),
    ("layers", None),
)


def check_rules(rules: Iterable[Sequence[str | None]]) -> Rules:
    """`rules` as a tuple of pairs, after checking every name; errors name the rule."""
    out = []
    for i, rule in enumerate(rules):
        if len(rule) != 2:
            raise ValueError(f"logical_axis_rules[{i}]={list(rule)!r}: a rule is [logical axis, mesh axis or null]")
        name, axis = rule
        if name not in LOGICAL_AXES:
            raise ValueError(f"logical_axis_rules[{i}]: logical axis {name!r} is not one of {', '.join(LOGICAL_AXES)}")
        if axis is not None and axis not in MESH_AXES:
            raise ValueError(f"logical_axis_rules[{i}]: mesh axis {axis!r} (for {name!r}) is not one of "
                             f"{', '.join(MESH_AXES)} or null")
        out.append((name, axis))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class LogicalSharding:
    """A rules table bound to a mesh (None: no sharding). `shard_heads`: whether attention heads may be split
    at all (both head counts must also divide the heads' mesh axis); `heads` = (query heads, kv heads)."""

    mesh: Mesh | None = None
    rules: Rules = DEFAULT_RULES
    heads: tuple[int, int] = (1, 1)
    shard_heads: bool = True

    def _head_axis_ok(self, axis: str) -> bool:
        size = self.mesh.shape[axis]
        ok = self.shard_heads and all(n % size == 0 for n in self.heads)
        if not ok and size > 1:
            why = "shard_attention_heads=False" if not self.shard_heads else (
                f"num_attention_heads={self.heads[0]} and num_key_value_heads={self.heads[1]} do not both divide {size}")
            warn_once(("logical", "heads", axis, size, self.heads, self.shard_heads),
                      f"attention heads are replicated over mesh axis {axis}={size}: {why}", logger=logger)
        return ok

    def spec(self, names: Sequence[str | None], shape: Sequence[int] | None = None, what: str | None = None,
             taken: Sequence[str] = ()) -> P:
        """The `PartitionSpec` of a tensor whose axes are `names` (None: never sharded), with the mesh axes
        `taken` already used. With `shape`, a dimension that does not divide its mesh axis is replicated
        (logged once when `what` names a weight)."""
        if self.mesh is None:
            return P()
        used: set[str] = set(taken)
        out: list[str | None] = []
        for i, name in enumerate(names):
            chosen = None
            for rule_name, axis in self.rules:
                if rule_name != name or axis is None or axis in used:
                    continue
                if name in HEAD_AXES and not self._head_axis_ok(axis):
                    break
                if shape is not None and shape[i] % self.mesh.shape[axis]:
                    if what is not None:
                        warn_once(("logical", what, i, axis), f"replicating dim of size {shape[i]} of {what}: not "
                                  f"divisible by mesh axis {axis}={self.mesh.shape[axis]}", logger=logger)
                    used.add(axis)  # still claimed: a later dim (an activation's embed) must not take it instead
                    continue
                chosen = axis
                break
            if chosen is not None:
                used.add(chosen)
            out.append(chosen)
        return P(*out)

    def sharding(self, names: Sequence[str | None], shape: Sequence[int] | None = None,
                 what: str | None = None) -> NamedSharding:
        if self.mesh is None:
            raise ValueError("LogicalSharding without a mesh has no NamedSharding")
        return NamedSharding(self.mesh, self.spec(names, shape, what))

    def constrain(self, x: jax.Array, names: Sequence[str | None], taken: Sequence[str] = ()) -> jax.Array:
        """`x` constrained to the layout its logical `names` give (identity without a mesh or on one device);
        a weight of a scanned stack seen whole has extra leading axes, named "layers"."""
        if self.one_device:
            return x
        if len(names) > x.ndim:
            raise ValueError(f"logical names {tuple(names)} do not match an array of shape {x.shape}")
        names = ("layers",) * (x.ndim - len(names)) + tuple(names)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(names, x.shape, taken=taken)))

    def gathered(self, w: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """A weight in its compute layout: as the rules place it once the batch has taken its mesh axes, i.e.
        gathered over the axes it is stored sharded on for ZeRO-3 ("embed" over "fsdp") and still split over
        the tensor-parallel ones. One all-gather per weight and layer, where GSPMD alone may reshard it in
        several hops."""
        return self.constrain(w, names, taken=self.batch_axes)

    def local(self, fn: Callable, in_names: Sequence, out_names, *shapes: Sequence[int],
              out_shapes: Sequence | None = None) -> Callable:
        """`fn` run per device on its shards (`jax.shard_map`) with inputs and outputs laid out by their logical
        names (`in_names`: one tuple of names per argument, None for a replicated argument such as a scalar;
        `out_names`: the output's, or a tuple of tuples for several; `shapes` / `out_shapes`: the arguments'
        and the outputs' shapes (one, or a tuple for several), so a dimension that does not divide its mesh
        axis stays whole). For kernels GSPMD cannot partition
        (Pallas/Mosaic calls) and for computations whose collectives tx writes itself (MoE experts). An
        argument whose names hold no "batch" (a weight) arrives in its compute layout (see `gathered`).
        Without a mesh, or on one device, `fn` itself."""
        if self.one_device:
            return fn
        shapes = shapes or (None,) * len(in_names)
        # an argument without a "batch" axis (a weight, a page pool) is read in its compute layout: as the rules
        # place it once the batch has taken its mesh axes (gathered over fsdp, split over tp / ep)
        in_specs = tuple(P() if names is None else
                         self.spec(names, shape, taken=() if "batch" in names else self.batch_axes)
                         for names, shape in zip(in_names, shapes))
        several = bool(out_names) and not isinstance(out_names[0], str) and out_names[0] is not None
        if several:
            out_shapes = out_shapes or (None,) * len(out_names)
            out_specs = tuple(self.spec(n, shape) for n, shape in zip(out_names, out_shapes))
        else:
            out_specs = self.spec(out_names, out_shapes)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def gathers(self, w: jax.Array, names: Sequence[str | None]) -> bool:
        """Whether the weight `w` named `names` is stored split over a mesh axis its compute layout is not
        (so `gathered` / `local` all-gather it)."""
        if self.one_device:
            return False
        return self.spec(names, w.shape) != self.spec(names, w.shape, taken=self.batch_axes)

    @property
    def one_device(self) -> bool:
        """No mesh, or a mesh of one device: nothing is sharded."""
        return self.mesh is None or self.mesh.size == 1

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes a batch's rows are split over."""
        return tuple(a for a in self.spec(("batch",)) if a is not None) if self.mesh is not None else ()


NO_SHARDING = LogicalSharding()
