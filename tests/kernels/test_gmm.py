"""Grouped matmul kernels (ragged_dot, blocked, megablox in Pallas interpret mode) == a numpy reference:
outputs and gradients wrt x and w, float32 to 1e-5."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx.kernels.gmm import gmm, resolve_impl, window_rows
from tx.models.layers.moe import present_slots

TOL = dict(rtol=1e-5, atol=1e-5)
CASES = {  # name: (group sizes, rows m); rows past sum(sizes) belong to no group
    "empty_groups": ([5, 0, 20, 0, 11, 1, 0], 37),
    "one_group_all_rows": ([0, 0, 45, 0], 45),
    "uneven_not_tile_multiple": ([1, 17, 3, 33, 2, 9], 65),
    "rows_past_groups": ([4, 0, 6], 13),
    "all_empty": ([0, 0, 0], 5),
}


def _reference(x, w, sizes, dy):
    """out[r] = x[r] w[g(r)]; dx = dy w[g].T; dw[g] = x[rows of g].T dy[rows of g] (float64 numpy)."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    group = np.full(x.shape[0], -1)
    group[: sum(sizes)] = np.repeat(np.arange(len(sizes)), sizes)
    out, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    for r, g in enumerate(group):
        if g >= 0:
            out[r] = x[r] @ w[g]
            dx[r] = dy[r] @ w[g].T
            dw[g] += np.outer(x[r], dy[r])
    return out, dx, dw


def _check(impl, sizes, m, i=12, o=9, **kw):
    rng = np.random.default_rng(len(sizes) * 100 + m)
    x = jnp.asarray(rng.standard_normal((m, i)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((len(sizes), i, o)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, o)), jnp.float32)
    sizes_g = jnp.asarray(sizes, jnp.int32)
    want, want_dx, want_dw = _reference(x, w, sizes, dy)
    fn = jax.jit(lambda x, w, s: gmm(x, w, s, impl=impl, **kw))
    np.testing.assert_allclose(fn(x, w, sizes_g), want, **TOL)
    dx, dw = jax.grad(lambda x, w: jnp.vdot(fn(x, w, sizes_g), dy), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(dx, want_dx, **TOL)
    np.testing.assert_allclose(dw, want_dw, **TOL)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("min_tile", [1, 4, 16])
def test_blocked_matches_reference(case, min_tile):
    _check("blocked", *CASES[case], min_tile=min_tile)


@pytest.mark.parametrize("case", sorted(CASES))
def test_ragged_dot_matches_reference(case):
    _check("ragged_dot", *CASES[case])


@pytest.mark.parametrize("case", ["empty_groups", "uneven_not_tile_multiple", "rows_past_groups"])
def test_megablox_interpret_matches_reference(case):
    _check("megablox", *CASES[case])


@pytest.mark.parametrize("impl", ["blocked", "ragged_dot", "megablox"])
def test_layer_of_a_stack_matches_reference(impl):
    """`layer` picks one layer of a stacked `[L, g, i, o]` weight: outputs and dx as with that layer's
    slice, dw zero except at `[layer]` (what a scanned MoE stack relies on)."""
    sizes, m, i, o, stack = [5, 0, 20, 3], 31, 12, 9, 3
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((m, i)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((stack, len(sizes), i, o)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, o)), jnp.float32)
    sizes_g = jnp.asarray(sizes, jnp.int32)
    fn = jax.jit(lambda x, w, layer: gmm(x, w, sizes_g, impl=impl, min_tile=4, layer=layer))
    for layer in range(stack):
        want, want_dx, want_dw = _reference(x, w[layer], sizes, dy)
        np.testing.assert_allclose(fn(x, w, jnp.int32(layer)), want, **TOL)
        dx, dw = jax.grad(lambda x, w: jnp.vdot(fn(x, w, jnp.int32(layer)), dy), argnums=(0, 1))(x, w)
        np.testing.assert_allclose(dx, want_dx, **TOL)
        np.testing.assert_allclose(dw[layer], want_dw, **TOL)
        assert not np.any(np.delete(np.asarray(dw), layer, axis=0))
    with pytest.raises(ValueError, match="with layer"):
        gmm(x, w[0], sizes_g, impl=impl, layer=jnp.int32(0))


def test_blocked_bf16_within_reference_error():
    """bf16 inputs, float32 accumulation: within ragged_dot's own bf16 error of the float32 result."""
    rng = np.random.default_rng(3)
    sizes = jnp.asarray([7, 0, 30, 3], jnp.int32)
    x = jnp.asarray(rng.standard_normal((40, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, 64, 32)), jnp.bfloat16)
    exact = np.asarray(jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes))
    got = np.asarray(gmm(x, w, sizes, impl="blocked", min_tile=4))
    ragged = np.asarray(jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32))
    assert np.abs(got - exact).max() <= max(np.abs(ragged - exact).max(), 1e-4)


@pytest.mark.parametrize("groups", [1, 4, 128, 2048])
def test_blocked_work_follows_rows_not_groups(groups):
    """The rows the blocked kernel multiplies: each group in one window that holds it, at most
    max(2 x its rows, min_tile), so the total is bounded by the rows routed whatever the group count
    (ragged_dot on CPU multiplies all m rows once per group)."""
    m, tile = 2048, 16
    rng = np.random.default_rng(groups)
    sizes = np.bincount(rng.integers(0, groups, m), minlength=groups)
    windows = np.asarray(window_rows(jnp.asarray(sizes, jnp.int32), m, tile))
    assert np.all(windows >= sizes) and np.all(windows[sizes == 0] == 0)
    assert np.all(windows <= np.maximum(2 * sizes, tile))
    assert windows.sum() <= 2 * m + tile * np.count_nonzero(sizes)


def test_resolve_impl_by_platform_and_bad_name():
    assert resolve_impl("auto", "cpu") == "blocked"
    assert resolve_impl("auto", "tpu") == "megablox"
    assert resolve_impl("auto", "gpu") == "ragged_dot"
    assert resolve_impl("ragged_dot", "cpu") == "ragged_dot"
    with pytest.raises(ValueError, match="'dense'"):
        resolve_impl("dense", "cpu")


def test_present_slots_renumbers_rows():
    slots, index = present_slots(jnp.asarray([5, 2, 5, 7, 2]), 8)
    assert slots.shape == (5,)  # static bound min(8 slots, 5 rows)
    np.testing.assert_array_equal(slots[:3], [2, 5, 7])
    np.testing.assert_array_equal(index, [1, 0, 1, 2, 0])
    slots, index = present_slots(jnp.asarray([3, 3, 3]), 2 + 2)
    np.testing.assert_array_equal(slots[:1], [3])
    np.testing.assert_array_equal(index, [0, 0, 0])


def test_blocked_backward_memory_is_one_weight_not_one_per_group():
    """The compiled gradient wrt (x, w) needs about one `[g, i, o]` buffer of temporaries (dw itself), not
    one full-size cotangent per loop step (what differentiating a loop over `w[g]` slices would give)."""
    m, i, o, g = 256, 64, 48, 64
    x = jnp.ones((m, i), jnp.float32)
    w = jnp.ones((g, i, o), jnp.float32)
    sizes = jnp.full((g,), m // g, jnp.int32)
    fn = jax.jit(jax.grad(lambda x, w: jnp.sum(gmm(x, w, sizes, impl="blocked") ** 2), argnums=(0, 1)))
    memory = fn.lower(x, w).compile().memory_analysis()
    live = memory.temp_size_in_bytes + memory.output_size_in_bytes
    assert live <= 2 * w.nbytes + 4 * x.nbytes + 4 * m * o * 4, (live, w.nbytes)


def _moe_kernels(model) -> set[str]:
    from flax import nnx

    from tx.models.layers.moe import SparseMoE

    return {m.moe_impl for _, m in nnx.iter_graph(model) if isinstance(m, SparseMoE)}


def test_the_suites_moe_models_run_ragged_dot_unless_marked(tiny_dirs):
    """The test processes' CPU MoE pick (tests/helpers.py: ragged_dot, cheap to compile); the model keeps it."""
    from tx.models.loading import load_model

    assert _moe_kernels(load_model(tiny_dirs["moe"])) == {"ragged_dot"}
    assert _moe_kernels(load_model(tiny_dirs["moe"], moe_impl="blocked")) == {"blocked"}


@pytest.mark.production_moe_kernel
def test_marked_tests_build_moe_models_with_txs_cpu_pick(tiny_dirs):
    from tx.models.loading import load_model

    assert _moe_kernels(load_model(tiny_dirs["moe"])) == {"blocked"}

