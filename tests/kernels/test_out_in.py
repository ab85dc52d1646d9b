"""`tx.kernels.out_in.out_in_product`: a `[out, in]` weight's product, as a multiply and a sum at 2-32 rows and
a matmul otherwise, against numpy in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx.kernels.out_in import REDUCE_ROWS, out_in_product


@pytest.mark.parametrize("b,t", [(1, 1), (2, 1), (8, 1), (32, 1), (1, 16), (33, 1), (64, 1), (4, 24)])
def test_product_matches_numpy_at_every_row_count(b, t):
    rng = np.random.default_rng(b * 100 + t)
    x = rng.standard_normal((b, t, 96)).astype(np.float32)
    w = rng.standard_normal((200, 96)).astype(np.float32)
    got = jax.jit(out_in_product)(jnp.asarray(x), jnp.asarray(w))
    assert got.dtype == jnp.float32 and got.shape == (b, t, 200)
    want = np.einsum("bti,oi->bto", x.astype(np.float64), w.astype(np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 8, 48])
def test_bfloat16_inputs_are_multiplied_in_float32(rows):
    """bf16 weights and inputs: each product is exact in float32 (8-bit mantissas), so the result is the
    float64 sum of the bf16 values to float32 rounding, as a float32-accumulating matmul gives."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 1, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((40, 64)), jnp.bfloat16)
    got = jax.jit(out_in_product)(x, w)
    assert got.dtype == jnp.float32
    want = np.einsum("bti,oi->bto", np.asarray(x, np.float64), np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)


def test_an_mlp_of_such_products_never_writes_the_broadcast_input():
    """An MLP of three such products (gate and up read one normalised input, down reads their product): the
    compiled program's temporaries stay far below the `[out, rows, in]` broadcast that XLA wrote out without
    the barrier (here 8 MB; in a decode step, every layer's, 1.8x slower)."""
    rows, d, ff = 8, 256, 1024
    assert REDUCE_ROWS[0] <= rows <= REDUCE_ROWS[1]

    def mlp(x_btd, gate_fd, up_fd, down_df):
        h_btd = x_btd * jax.lax.rsqrt(jnp.mean(x_btd * x_btd, axis=-1, keepdims=True) + 1e-6)
        g_btf = jax.nn.silu(out_in_product(h_btd, gate_fd)) * out_in_product(h_btd, up_fd)
        return x_btd + out_in_product(g_btf, down_df)

    args = (jnp.ones((rows, 1, d)), jnp.ones((ff, d)), jnp.ones((ff, d)), jnp.ones((d, ff)))
    memory = jax.jit(mlp).lower(*args).compile().memory_analysis()
    if memory is None:
        pytest.skip("no memory analysis on this backend")
    assert memory.temp_size_in_bytes < ff * rows * d * 4 // 8


@pytest.mark.parametrize("rows,summed", [(1, False), (2, True), (32, True), (33, False)])
def test_the_sum_runs_at_2_to_32_rows_and_the_matmul_otherwise(rows, summed):
    text = jax.jit(out_in_product).lower(jnp.ones((rows, 1, 16)), jnp.ones((24, 16))).as_text()
    assert ("dot_general" not in text) == summed
