"""Row groups (tx/kernels/row_groups.py): how many groups, and the same rows' results as at once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx.kernels.row_groups import group_count, map_row_groups


@pytest.mark.parametrize("rows,per_row,most,groups", [(64, 64, 1024, 4), (16, 64, 1024, 1), (8, 128, 1024, 1),
                                                      (32, 128, 1024, 4), (3, 1000, 1024, 1), (6, 512, 1024, 2),
                                                      (64, 1, 1024, 1), (64, 64, None, 1),
                                                      (512, 32000, 2**21, 8), (512, 151936, 2**21, 64),
                                                      (1, 151936, 2**21, 1)])
def test_group_count(rows, per_row, most, groups):
    assert group_count(rows, per_row, most) == groups


def test_map_row_groups_joins_each_groups_rows_in_order():
    """A row-wise function of several arguments (one None) with a tuple result: per row, numpy's values;
    the program loops over the groups."""
    rng = np.random.default_rng(0)
    x_bv = rng.normal(size=(8, 5)).astype(np.float32)
    w_b = rng.normal(size=8).astype(np.float32)

    def fn(x_bv, w_b, none):
        assert none is None
        return jnp.max(x_bv, axis=-1) * w_b, jnp.argmax(x_bv, axis=-1)

    for k in (1, 2, 8):
        grouped = jax.jit(lambda x, w, k=k: map_row_groups(fn, (x, w, None), k))
        top_b, ids_b = grouped(x_bv, w_b)
        np.testing.assert_allclose(np.asarray(top_b), x_bv.max(-1) * w_b, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(ids_b), x_bv.argmax(-1))
        loops = grouped.lower(x_bv, w_b).as_text().count("stablehlo.while")
        assert (loops > 0) == (k > 1), (k, loops)
