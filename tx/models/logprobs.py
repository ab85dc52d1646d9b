"""Target-token log-probabilities in float32, computed over token chunks.

Training never materialises `[tokens, vocab]` logits: tokens are processed `chunk_size` at a time under
`lax.map`, and each chunk is rematerialised in the backward pass (`jax.checkpoint`), so peak logits memory
is `chunk_size * vocab` floats in both passes.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

LogitsFn = Callable[[jax.Array, jax.Array | None], jax.Array]  # (h [n, d], adapter [n] | None) -> f32 [n, v]


def logprobs_from_logits(logits_nv: jax.Array, targets_n: jax.Array) -> jax.Array:
    logits_nv = logits_nv.astype(jnp.float32)
    target_logit_n = jnp.take_along_axis(logits_nv, targets_n[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return target_logit_n - jax.nn.logsumexp(logits_nv, axis=-1)


def chunked_target_logprobs(
    logits_fn: LogitsFn,
    hidden_nd: jax.Array,
    targets_n: jax.Array,
    adapter_n: jax.Array | None,
    chunk_size: int,
) -> jax.Array:
    """log p(targets_n[i] | hidden_nd[i]) for every token, float32 [n]."""
    n = hidden_nd.shape[0]
    chunk = max(1, min(chunk_size, n))
    pad = -n % chunk
    chunks = (n + pad) // chunk
    h_cnd = jnp.pad(hidden_nd, ((0, pad), (0, 0))).reshape(chunks, chunk, -1)
    t_cn = jnp.pad(targets_n, (0, pad)).reshape(chunks, chunk)
    a_cn = None if adapter_n is None else jnp.pad(adapter_n, (0, pad)).reshape(chunks, chunk)

    @jax.checkpoint
    def one_chunk(args):
        h_nd, t_n, a_n = args
        return logprobs_from_logits(logits_fn(h_nd, a_n), t_n)

    return jax.lax.map(one_chunk, (h_cnd, t_cn, a_cn)).reshape(-1)[:n]
