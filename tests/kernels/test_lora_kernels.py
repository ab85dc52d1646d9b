import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx.kernels.lora import lora_delta_grouped, lora_delta_reference, lora_delta_rows, make_routing


def _weights(rng, g, i, r, o):
    return (
        jnp.asarray(rng.standard_normal((g, i, r)), jnp.float32),
        jnp.asarray(rng.standard_normal((g, r, o)), jnp.float32),
        jnp.asarray(rng.uniform(0.5, 2.0, g), jnp.float32),
    )


def test_rows_matches_reference_and_gradients():
    rng = np.random.default_rng(0)
    b, t, i, r, o, g = 5, 7, 12, 4, 9, 6
    x = jnp.asarray(rng.standard_normal((b, t, i)), jnp.float32)
    adapter_b = jnp.asarray([3, 0, 3, 5, 1])
    a, bb, s = _weights(rng, g, i, r, o)
    got = lora_delta_rows(x, adapter_b, a, bb, s)
    group_n = jnp.repeat(adapter_b, t)
    want = lora_delta_reference(x.reshape(-1, i), group_n, a, bb, s[group_n]).reshape(b, t, o)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def loss(fn, a, bb, x):
        return jnp.sum(jnp.sin(fn(a, bb, x)))

    fast = jax.grad(loss, argnums=(1, 2, 3))(lambda a, bb, x: lora_delta_rows(x, adapter_b, a, bb, s), a, bb, x)
    ref = jax.grad(loss, argnums=(1, 2, 3))(
        lambda a, bb, x: lora_delta_reference(x.reshape(-1, i), group_n, a, bb, s[group_n]).reshape(b, t, o), a, bb, x
    )
    for got_g, want_g in zip(fast, ref):
        np.testing.assert_allclose(got_g, want_g, rtol=1e-4, atol=1e-4)
    # adapters absent from the batch get exactly zero gradient
    assert not np.any(np.asarray(fast[0])[[2, 4]])


def test_grouped_matches_reference_with_empty_groups():
    rng = np.random.default_rng(1)
    n, i, r, o, g = 40, 8, 3, 6, 10
    group_n = jnp.asarray(rng.choice([0, 2, 3, 7], n))  # groups 1, 4, 5, 6, 8, 9 empty
    x = jnp.asarray(rng.standard_normal((n, i)), jnp.float32)
    a, bb, _ = _weights(rng, g, i, r, o)
    routing = make_routing(group_n, g)
    got = lora_delta_grouped(x[routing.sort_n], a, bb, routing.group_sizes_g)[routing.unsort_n]
    want = lora_delta_reference(x, group_n, a, bb, jnp.ones(n))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(routing.group_sizes_g), np.bincount(np.asarray(group_n), minlength=g))


def _flops(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


@pytest.mark.parametrize("slots", [2, 64])
def test_rows_cost_independent_of_adapters(slots):
    """FLOPs do not grow with the number of slots; 1 vs 16 adapters in a batch is the same program."""
    rng = np.random.default_rng(2)
    b, t, i, r, o = 16, 32, 64, 8, 64
    x = jnp.asarray(rng.standard_normal((b, t, i)), jnp.float32)
    a, bb, s = _weights(rng, slots, i, r, o)
    flops = _flops(lora_delta_rows, x, jnp.zeros(b, jnp.int32), a, bb, s)
    matmul_flops = 2 * b * t * r * (i + o)
    assert matmul_flops <= flops < 1.5 * matmul_flops
    fn = jax.jit(lambda *args: lora_delta_rows(*args))  # fresh cache
    one = fn(x, jnp.ones(b, jnp.int32), a, bb, s)
    many = fn(x, jnp.arange(b, dtype=jnp.int32) % slots, a, bb, s)
    assert fn._cache_size() == 1
    assert one.shape == many.shape
