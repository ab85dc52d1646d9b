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

Memory: one more copy of the layer weights (`Qwen3.layer_bytes()`), held while the engine lives; the
"auto" rule (`paged_calls.decode_layers_unrolled`) takes unrolled decode only where that is at most a
quarter of the free memory.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax


@jax.jit
def _unstack(stacked: jax.Array) -> list[jax.Array]:
    return [stacked[i] for i in range(stacked.shape[0])]


class _Stack:
    """One stack's copies: per leaf, the stacked array it was copied from (by weak reference) and its per-layer
    copies; and those copies assembled per layer (what a decode call takes)."""

    def __init__(self, leaves: int) -> None:
        self.sources: list[weakref.ref | None] = [None] * leaves
        self.copies: list[list[jax.Array] | None] = [None] * leaves
        self.layers: list[list[jax.Array]] | None = None


class LayerCopies:
    """The copies one engine keeps (`get` per decode call)."""

    def __init__(self) -> None:
        self._stacks: dict[int, _Stack] = {}
        self.copied = 0  # stacked leaves copied so far (tests and metrics: base weights only once)

    def get(self, model: Any) -> tuple[tuple[Any, ...], list[list[list[jax.Array]]]]:
        """Per stack of `model` (`scanned_states()`): the tree structure of one layer's state (a static argument
        of the decode program, `unflatten` there) and each layer's leaves. Plain lists, not per-layer states:
        flattening 28 `nnx.State`s at every call cost ~11 ms on the host, a list of arrays ~0.1 ms. A leaf is
        copied again only when the model holds a new array for it; unchanged stacks reuse their lists."""
        defs, out = [], []
        for s, state in enumerate(model.scanned_states()):
            leaves, treedef = jax.tree.flatten(state)
            defs.append(treedef)
            stack = self._stacks.get(s)
            if stack is None or len(stack.sources) != len(leaves):
                stack = self._stacks[s] = _Stack(len(leaves))
            stale = [j for j, leaf in enumerate(leaves) if stack.sources[j] is None or stack.sources[j]() is not leaf]
            if stale:
                # the per-layer lists go first: each stale leaf's copies are freed as its new ones are made (after
                # a full-weight optimizer step, every leaf), never a whole second set at once
                stack.layers = None
                for j in stale:
                    stack.sources[j], stack.copies[j] = weakref.ref(leaves[j]), _unstack(leaves[j])
                    self.copied += 1
            if stack.layers is None:
                stack.layers = [list(layer) for layer in zip(*stack.copies)]
            out.append(stack.layers)
        return tuple(defs), out


def layer_states(defs: tuple[Any, ...], layers: list[list[list[jax.Array]]]) -> list[list[Any]]:
    """`LayerCopies.get`'s output as per stack, its state one layer at a time (inside the decode program)."""
    return [[jax.tree.unflatten(treedef, leaves) for leaves in stack] for treedef, stack in zip(defs, layers)]
