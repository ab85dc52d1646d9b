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


class LayerCopies:
    """The copies one engine keeps (`get` per decode call)."""

    def __init__(self) -> None:
        # (stack, leaf) -> (the stacked array it was copied from, by weak reference; its per-layer copies)
        self._leaves: dict[tuple[int, int], tuple[weakref.ref, list[jax.Array]]] = {}
        # stack -> its leaves by weak reference and its per-layer leaf lists, reused while no leaf changed
        self._stacks: dict[int, tuple[list[weakref.ref], list[list[jax.Array]]]] = {}
        self.copied = 0  # stacked leaves copied so far (tests and metrics: base weights only once)

    def get(self, model: Any) -> tuple[tuple[Any, ...], list[list[list[jax.Array]]]]:
        """Per stack of `model` (`scanned_states()`): the tree structure of one layer's state (a static argument
        of the decode program, `unflatten` there) and each layer's leaves. Plain lists, not per-layer states:
        flattening 28 `nnx.State`s at every call cost ~11 ms on the host, a list of arrays ~0.1 ms."""
        defs, out = [], []
        for s, state in enumerate(model.scanned_states()):
            leaves, treedef = jax.tree.flatten(state)
            defs.append(treedef)
            held = self._stacks.get(s)
            if held is not None and len(held[0]) == len(leaves) and all(
                    ref() is leaf for ref, leaf in zip(held[0], leaves)):
                out.append(held[1])
                continue
            # dropped first: each stale leaf's copies are freed as its new ones are made (after a full-weight
            # optimizer step, every leaf), never a whole second set at once
            self._stacks.pop(s, None)
            held = None
            per_leaf = [self._layers_of(s, j, leaf) for j, leaf in enumerate(leaves)]
            layers = [[copies[i] for copies in per_leaf] for i in range(len(per_leaf[0]) if per_leaf else 0)]
            self._stacks[s] = ([weakref.ref(leaf) for leaf in leaves], layers)
            out.append(layers)
        return tuple(defs), out

    def _layers_of(self, s: int, j: int, leaf: jax.Array) -> list[jax.Array]:
        held = self._leaves.get((s, j))
        if held is None or held[0]() is not leaf:
            held = (weakref.ref(leaf), _unstack(leaf))
            self._leaves[(s, j)] = held
            self.copied += 1
        return held[1]


def layer_states(defs: tuple[Any, ...], layers: list[list[list[jax.Array]]]) -> list[list[Any]]:
    """`LayerCopies.get`'s output as per stack, its state one layer at a time (inside the decode program)."""
    return [[jax.tree.unflatten(treedef, leaves) for leaves in stack] for treedef, stack in zip(defs, layers)]
