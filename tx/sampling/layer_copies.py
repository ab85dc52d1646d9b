"""Per-layer copies of the model's stacked layer weights, kept between decode calls (unrolled decode,
`paged_decode_layers`).

Under `lax.scan` a decode step slices every layer's weights out of the stacks again, which on CPU is a copy
of every weight at every step. Unrolled decode runs the layers one by one on per-layer arrays instead. Made
inside each decode call, those copies cost a fixed ~50 ms per call at a 100M shape on a 2-core CPU (more
than two decode steps), so they are made here, once, and passed to every call. A stacked leaf is copied
again only when the model holds a different array for it: an optimizer step or a weight load replaces an
adapter's LoRA leaves (small), and the base weights (the bulk) are copied once. The sources are held by
weak reference (identity is the check, and a replaced stack is freed as usual); JAX arrays are immutable
and every update makes new ones, so an unchanged identity means unchanged values.

Layout (`out_in`, on CPU): the dense kernels' copies (attention projections and MLP) are stored `[out, in]`
(`OutInKernel`, read by `LoRALinear`), and an untied LM head gets a `[vocab, d]` copy, which decode programs
of two or more rows read. In this layout a product of 2-32 rows runs as a multiply and a sum, 1.3-2x the
matmul's speed (`tx.kernels.out_in`; a whole 8-row call 1.16-1.2x); larger calls run the matmul, which reads
this layout about as fast as `[in, out]` (earlier runs 1.05-1.3x faster for the MLP kernels and head at 8-64
rows, one run 0.8-1.0x; RL sampling, mostly such calls, level). One row keeps the model's head (its one-row
product ~5% slower from the copy). The q/k/v kernels are one copy, and gate/up another (`FUSED_GROUPS`, read
by `lora.grouped`): one product reads the group's weights in one pass, which at one row streams them faster
(whole batch-1 calls 0.95-0.96x the time, level at 8 and 64 rows; docs/performance.md). Not on other
platforms: their matmul libraries take either layout.

Memory: one more copy of the layer weights (`Qwen3.layer_bytes()`), and of an untied head with `out_in`
(made at the first decode call of two or more rows), held while the engine lives; the "auto" rule
(`call_shapes.decode_layers_unrolled`) takes unrolled decode only where that is at most a quarter of the
free memory.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tx.models.layers.lora import FUSED_GROUPS, OUT_IN_MODULES, OutInKernel


class Copies(NamedTuple):
    """What a decode or prefill call takes: per stack, each layer's leaves; the untied head as `[vocab, d]` (with
    `out_in`), else None."""

    stacks: list[list[list[jax.Array]]]
    head_vd: jax.Array | None


@jax.jit
def _unstack(stacked: jax.Array) -> list[jax.Array]:
    return [stacked[i] for i in range(stacked.shape[0])]


@jax.jit
def _unstack_out_in(*stacked_lio: jax.Array) -> list[jax.Array]:
    """Per layer, the kernels `stacked_lio` (`[layers, in, out_j]`) as one `[sum of out_j, in]` array."""
    return [jnp.concatenate([s[i].T for s in stacked_lio]) for i in range(stacked_lio[0].shape[0])]


_transpose = jax.jit(lambda w: w.T)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _layout(state: Any, out_in: bool) -> tuple[Any, list[tuple[int, ...] | None]]:
    """The tree structure of one layer's copies and, per leaf, what its copy holds: `()` the leaf's layer slice
    as stored; else (with `out_in`) the leaves, by index, whose kernels it holds stacked `[out, in]`: a dense
    `OUT_IN_MODULES` kernel (`[layers, in, out]` stacks; MoE experts keep their layout) its own, the first
    module of a `FUSED_GROUPS` group the group's; None for the group's others (an empty placeholder)."""
    flat, outer = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_variable)
    kernels: dict[tuple, int] = {}  # (parent module's path, module name) -> leaf index
    for j, (path, var) in enumerate(flat):
        names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        if (out_in and len(names) >= 2 and names[-1] == "kernel" and names[-2] in OUT_IN_MODULES
                and var[...].ndim == 3):
            kernels[names[:-2], names[-2]] = j
    plan: list[tuple[int, ...] | None] = [()] * len(flat)
    for j in kernels.values():
        plan[j] = (j,)
    for parent, group in {(parent, group) for parent, _ in kernels for group in FUSED_GROUPS}:
        members = tuple(kernels.get((parent, name)) for name in group)
        if None not in members:
            plan[members[0]] = members
            for j in members[1:]:
                plan[j] = None
    copies = []
    for (_, var), members in zip(flat, plan):
        if members == ():
            copies.append(var)
        elif members is not None and len(members) > 1:
            copies.append(OutInKernel(var[...], parts=tuple(flat[m][1][...].shape[-1] for m in members)))
        else:  # its own kernel, or a fused group's placeholder
            copies.append(OutInKernel(var[...]))
    return jax.tree.structure(jax.tree.unflatten(outer, copies)), plan


class _Stack:
    """One stack's copies: per leaf, the stacked array it was copied from (by weak reference) and its per-layer
    copies; and those copies assembled per layer (what a decode call takes)."""

    def __init__(self, treedef: Any, plan: list[tuple[int, ...] | None]) -> None:
        self.treedef, self.plan = treedef, plan
        # the leaf whose copy holds each leaf (itself, or its fused group's first module)
        self.holder = list(range(len(plan)))
        for j, members in enumerate(plan):
            for m in members or ():
                self.holder[m] = j
        self.sources: list[weakref.ref | None] = [None] * len(plan)
        self.copies: list[list[jax.Array] | None] = [None] * len(plan)
        self.layers: list[list[jax.Array]] | None = None


class LayerCopies:
    """The copies one engine keeps (`get` per decode call); `out_in`: in the CPU layout (module docstring)."""

    def __init__(self, out_in: bool = False) -> None:
        self.out_in = out_in
        self._stacks: dict[int, _Stack] = {}
        self._head: tuple[weakref.ref, jax.Array] | None = None  # the head kernel copied, its copy
        self.copied = 0  # stacked leaves copied so far (tests and metrics: base weights only once)

    def get(self, model: Any, head: bool = True) -> tuple[tuple[Any, ...], Copies]:
        """Per stack of `model` (`scanned_states()`): the tree structure of one layer's copies (a static argument
        of the decode program, `unflatten` there) and each layer's leaves; the head's copy if `head` (made at the
        first call that asks: an engine that only decodes one row never holds it), else None. Plain lists, not
        per-layer states: flattening 28 `nnx.State`s at every call cost ~11 ms on the host, a list of arrays
        ~0.1 ms. A leaf is copied again only when the model holds a new array for it; unchanged stacks reuse
        their lists."""
        defs, out = [], []
        for s, state in enumerate(model.scanned_states()):
            leaves = jax.tree.leaves(state)
            stack = self._stacks.get(s)
            if stack is None or len(stack.sources) != len(leaves):
                stack = self._stacks[s] = _Stack(*_layout(state, self.out_in))
            defs.append(stack.treedef)
            stale = [j for j, leaf in enumerate(leaves) if stack.sources[j] is None or stack.sources[j]() is not leaf]
            if stale:
                # the per-layer lists go first, and a leaf's stale copies before its new ones are made (after a
                # full-weight optimizer step every leaf is new): never a whole second set at once
                stack.layers = None
                for j in sorted({stack.holder[j] for j in stale}):
                    members = stack.plan[j] or (j,)
                    stack.copies[j] = None
                    if stack.plan[j]:
                        stack.copies[j] = _unstack_out_in(*(leaves[m] for m in members))
                    else:
                        stack.copies[j] = _unstack(leaves[j])
                    for m in members[1:]:
                        stack.copies[m] = [_placeholder(leaves[m])] * len(stack.copies[j])
                    for m in members:
                        stack.sources[m] = weakref.ref(leaves[m])
                    self.copied += len(members)
            if stack.layers is None:
                stack.layers = [list(layer) for layer in zip(*stack.copies)]
            out.append(stack.layers)
        return tuple(defs), Copies(out, self._head_copy(model) if head else None)

    @property
    def head_bytes(self) -> int:
        """Bytes of the head's copy held now (0: none made yet, or none needed)."""
        return 0 if self._head is None else self._head[1].nbytes

    def _head_copy(self, model: Any) -> jax.Array | None:
        head_dv = model.head_kernel() if self.out_in else None
        if head_dv is None:
            return None
        if self._head is None or self._head[0]() is not head_dv:
            self._head = None  # the old copy goes before the new one is made
            self._head = weakref.ref(head_dv), _transpose(head_dv)
            self.copied += 1
        return self._head[1]


def _placeholder(stacked_lio: jax.Array) -> jax.Array:
    """An empty `[0, in]` stand-in for a fused group's other kernels (their values sit in the first's copy)."""
    return jnp.zeros((0, stacked_lio.shape[1]), stacked_lio.dtype)


def layer_states(defs: tuple[Any, ...], layers: list[list[list[jax.Array]]]) -> list[list[Any]]:
    """`LayerCopies.get`'s stacks as per stack, its state one layer at a time (inside the decode program)."""
    return [[jax.tree.unflatten(treedef, leaves) for leaves in stack] for treedef, stack in zip(defs, layers)]
