"""Row-wise work over a batch in groups of consecutive rows, one group after the other (`lax.map`).

A row's results are the same bits either way (each group is a smaller batch of the same rows); what changes is
the working set: a group's intermediates are a fraction of the batch's, so they can stay in a CPU's cache and
the program's temporary buffer shrinks with them (sampling prefill's MLP, `tx.models.decoder`; a large decode
call's token choice over the vocabulary, `tx.sampling.paged_step`; its attention on CPU, `tx.kernels.paged_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def group_count(rows: int, per_row: int, most: int | None) -> int:
    """Into how many groups of rows (a power of 2 dividing `rows`) work of `per_row` elements a row goes: the
    fewest groups of at most `most` elements each, as far as halving divides `rows` (1: at once; `most` None:
    always at once)."""
    k = 1
    while most is not None and rows // k * per_row > most and rows % (2 * k) == 0:
        k *= 2
    return k


def map_row_groups(fn: Callable[..., Any], args: tuple[jax.Array | None, ...], k: int) -> Any:
    """`fn(*args)` computed over `k` groups of consecutive rows of every array in `args` (leading axis; None
    passes through as None), the groups' results (a pytree of arrays with rows first) joined back in order."""
    if k == 1:
        return fn(*args)

    def split(x: jax.Array | None) -> jax.Array | None:
        return None if x is None else x.reshape(k, x.shape[0] // k, *x.shape[1:])

    out = jax.lax.map(lambda xs: fn(*xs), tuple(split(x) for x in args))
    return jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:]), out)
