"""tx/sampling/layer_copies.py on its own: per-layer copies of stacked weights, reused while the stacks are
unchanged, remade leaf by leaf when the model holds new arrays, with the stale copies freed as they go."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from tx.sampling import layer_copies
from tx.sampling.layer_copies import LayerCopies, layer_states


class Model:
    """What `LayerCopies.get` reads: `scanned_states()`, per stack a pytree of `[layers, ...]` arrays."""

    def __init__(self, **leaves):
        self.state = dict(leaves)

    def scanned_states(self):
        return [self.state]


def stacked(seed: int, layers: int = 3) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((layers, 2, 4)), jnp.float32)


def test_copies_match_the_stacks_and_are_reused_while_unchanged():
    model = Model(a=stacked(0), b=stacked(1))
    copies = LayerCopies()
    defs, layers = copies.get(model)
    states = layer_states(defs, layers)
    assert len(states) == 1 and len(states[0]) == 3
    for i, state in enumerate(states[0]):
        for name in ("a", "b"):
            np.testing.assert_array_equal(np.asarray(state[name]), np.asarray(model.state[name][i]))
    assert copies.copied == 2
    again_defs, again = copies.get(model)
    assert again_defs == defs and again[0] is layers[0] and copies.copied == 2  # nothing copied or assembled


def test_a_replaced_leaf_is_copied_again_and_its_stale_copies_are_freed_first(monkeypatch):
    model = Model(a=stacked(0), b=stacked(1))
    copies = LayerCopies()
    _, layers = copies.get(model)
    kept_b = layers[0][0][1]  # leaves in tree order: a, b
    stale = [weakref.ref(layer[0]) for layer in layers[0]] + [weakref.ref(layer[1]) for layer in layers[0]]
    del layers
    model.state = {"a": stacked(2), "b": stacked(3)}  # a full-weight optimizer step: every leaf new
    made = []
    unstack = layer_copies._unstack

    def watched(leaf):
        gc.collect()
        # when leaf j is copied, the copies of leaves < j are already gone: never two full sets at once
        made.append(sum(ref() is not None for ref in stale))
        return unstack(leaf)

    monkeypatch.setattr(layer_copies, "_unstack", watched)
    defs, layers = copies.get(model)
    assert made == [6, 3], made  # a's 3 stale copies were freed before b's new ones were made
    assert copies.copied == 4 and layers[0][0][1] is not kept_b
    np.testing.assert_array_equal(np.asarray(layer_states(defs, layers)[0][2]["b"]), np.asarray(model.state["b"][2]))
    model.state = {"a": model.state["a"], "b": stacked(4)}  # one leaf new (a LoRA update): only it is copied
    _, again = copies.get(model)
    assert copies.copied == 5 and again[0][1][0] is layers[0][1][0]
