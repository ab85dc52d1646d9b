"""tx/sampling/layer_copies.py on its own: per-layer copies of stacked weights, reused while the stacks are
unchanged, remade leaf by leaf when the model holds new arrays, with the stale copies freed as they go."""

import functools
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
    assert layers.head_vd is None  # the default layout copies no head
    layers = layers.stacks
    states = layer_states(defs, layers)
    assert len(states) == 1 and len(states[0]) == 3
    for i, state in enumerate(states[0]):
        for name in ("a", "b"):
            np.testing.assert_array_equal(np.asarray(state[name]), np.asarray(model.state[name][i]))
    assert copies.copied == 2
    again_defs, again = copies.get(model)
    assert again_defs == defs and again.stacks[0] is layers[0] and copies.copied == 2  # nothing copied or assembled


def test_a_replaced_leaf_is_copied_again_and_its_stale_copies_are_freed_first(monkeypatch):
    model = Model(a=stacked(0), b=stacked(1))
    copies = LayerCopies()
    layers = copies.get(model)[1].stacks
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
    defs, (layers, _) = copies.get(model)
    assert made == [3, 1], made  # each leaf's 3 stale copies were freed before its new ones were made (1: kept_b)
    assert copies.copied == 4 and layers[0][0][1] is not kept_b
    np.testing.assert_array_equal(np.asarray(layer_states(defs, layers)[0][2]["b"]), np.asarray(model.state["b"][2]))
    model.state = {"a": model.state["a"], "b": stacked(4)}  # one leaf new (a LoRA update): only it is copied
    again = copies.get(model)[1].stacks
    assert copies.copied == 5 and again[0][1][0] is layers[0][1][0]


class MlpModel:
    """`scanned_states()` of one stack of 3 LoRA MLP layers plus attention-like `q_proj` / `k_proj` / `v_proj`,
    and an LM head kernel."""

    def __init__(self, head_dv):
        from flax import nnx

        from tx.models.layers.lora import LoRALinear
        from tx.models.layers.mlp import MLP

        class Layer(nnx.Module):
            def __init__(self, stack, rngs):
                self.mlp = MLP(8, 24, num_adapters=2, rank=2, stack=stack, dtype=jnp.float32, rngs=rngs)
                self.q_proj = LoRALinear(8, 8, num_adapters=2, rank=2, stack=stack, rngs=rngs)
                self.k_proj = LoRALinear(8, 4, num_adapters=2, rank=2, stack=stack, rngs=rngs)
                self.v_proj = LoRALinear(8, 4, num_adapters=2, rank=2, stack=stack, rngs=rngs)

        self.graphdef = nnx.split(Layer((), nnx.Rngs(0)))[0]  # one layer's module, for `nnx.merge`
        rng = np.random.default_rng(1)  # every leaf random, LoRA factors and scales too: all of it computes
        self.state = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype),
                                  nnx.state(Layer((3,), nnx.Rngs(1))))
        self.head_dv = head_dv

    def scanned_states(self):
        return [self.state]

    def head_kernel(self):
        return self.head_dv


def kernel_of(tree, *path):
    return functools.reduce(lambda tree, key: tree[key], path, tree)["kernel"]


def test_out_in_copies_store_kernels_transposed_and_fused_and_compute_the_same():
    """The CPU layout: the dense kernels' copies (attention projections, MLP) are `[out, in]` (`OutInKernel`,
    which `LoRALinear` contracts on its last axis); q/k/v and gate/up are each one copy, their kernels stacked
    along `out` on the group's first module (`parts`: the widths), the others an empty placeholder; other leaves
    as stacked. An untied head gets one `[vocab, d]` copy, made again only when the model holds a new head. Each
    layer computes what the model's own layer slice computes, through `grouped` too (to float32 rounding: 6 rows
    take `out_in_product`'s sum)."""
    from flax import nnx

    from tx.models.layers.lora import LoraA, OutInKernel, grouped

    head_dv = stacked(5, layers=8)[:, 0]  # [d 8, vocab 4]
    model = MlpModel(head_dv)
    copies = LayerCopies(out_in=True)
    defs, got = copies.get(model)
    np.testing.assert_array_equal(np.asarray(got.head_vd), np.asarray(head_dv).T)
    layers = layer_states(defs, got.stacks)[0]
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, 8)), jnp.float32)
    adapter = jnp.asarray([0, 1])
    groups = [((("mlp", "gate_proj"), ("mlp", "up_proj")), (24, 24)), ((("mlp", "down_proj"),), None),
              ((("q_proj",), ("k_proj",), ("v_proj",)), (8, 4, 4))]
    for i, layer in enumerate(layers):
        for paths, parts in groups:
            kernels = [kernel_of(layer, *path) for path in paths]
            assert all(isinstance(kernel, OutInKernel) for kernel in kernels)
            assert getattr(kernels[0], "parts", None) == parts
            want_oi = np.concatenate([np.asarray(kernel_of(model.state, *path)[...])[i].T for path in paths])
            np.testing.assert_array_equal(np.asarray(kernels[0][...]), want_oi)
            assert all(kernel[...].shape == (0, 8) for kernel in kernels[1:])
        assert type(layer["q_proj"]["lora_a"]) is LoraA  # other leaves as stacked
        sliced = jax.tree.map(lambda a: a[i], model.state)
        mine, want = nnx.merge(model.graphdef, layer), nnx.merge(model.graphdef, sliced)
        want_out = np.asarray(want.mlp(x, adapter))
        assert np.abs(want_out).max() > 1.0
        np.testing.assert_allclose(np.asarray(mine.mlp(x, adapter)), want_out, rtol=1e-5, atol=1e-5)
        for a, b in zip(grouped((mine.q_proj, mine.k_proj, mine.v_proj), x, adapter),
                        (want.q_proj(x, adapter), want.k_proj(x, adapter), want.v_proj(x, adapter)), strict=True):
            assert a.shape == b.shape
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    made = copies.copied
    assert copies.get(model)[1].head_vd is got.head_vd and copies.copied == made  # unchanged: nothing copied
    model.head_dv = stacked(6, layers=8)[:, 0]  # a full-weight step trained the head
    again = copies.get(model)[1]
    assert copies.copied == made + 1 and again.stacks[0] is got.stacks[0]
    np.testing.assert_array_equal(np.asarray(again.head_vd), np.asarray(model.head_dv).T)
    model.head_dv = None  # tied: the head is the embedding, already `[vocab, d]`
    assert copies.get(model)[1].head_vd is None


def test_a_new_kernel_of_a_fused_group_remakes_the_groups_copy_only():
    """One new kernel of a fused group (`up_proj`): the group's copy is made again from both kernels (2 leaves
    copied), the other copies are kept as they are."""
    model = MlpModel(None)
    copies = LayerCopies(out_in=True)
    defs, got = copies.get(model)
    made, old = copies.copied, [list(layer) for layer in got.stacks[0]]
    up = model.state["mlp"]["up_proj"]["kernel"]
    model.state["mlp"]["up_proj"]["kernel"] = up.replace(up[...] * 2.0)
    defs, again = copies.get(model)
    assert copies.copied == made + 2
    layers = layer_states(defs, again.stacks)[0]
    for i, layer in enumerate(layers):
        want_oi = np.concatenate([np.asarray(kernel_of(model.state, "mlp", name)[...])[i].T
                                  for name in ("gate_proj", "up_proj")])
        np.testing.assert_array_equal(np.asarray(kernel_of(layer, "mlp", "gate_proj")[...]), want_oi)
        kept = [j for j, leaf in enumerate(again.stacks[0][i]) if leaf is old[i][j]]
        assert len(kept) == len(old[i]) - 2  # all but the group's two leaves (its copy and its placeholder)


def test_out_in_leaves_expert_kernels_as_they_are():
    """MoE experts' `gate_proj` kernels (`[layers, experts, in, out]`) keep their layout: `ExpertLinear` reads them
    through the grouped matmuls."""
    from flax import nnx

    experts = nnx.Param(jnp.asarray(np.random.default_rng(3).standard_normal((2, 4, 8, 6)), jnp.float32))
    model = Model(experts={"gate_proj": {"kernel": experts}})
    model.head_kernel = lambda: None
    defs, got = LayerCopies(out_in=True).get(model)
    layer = layer_states(defs, got.stacks)[0][1]
    assert type(layer["experts"]["gate_proj"]["kernel"]) is nnx.Param
    np.testing.assert_array_equal(np.asarray(layer["experts"]["gate_proj"]["kernel"][...]), np.asarray(experts[...][1]))
