"""Target-token log-probabilities in float32, computed over token chunks.

Training never materialises `[tokens, vocab]` logits: tokens are processed `chunk_size` at a time under
`lax.map`, and each chunk is rematerialised in the backward pass (`jax.checkpoint`), so peak logits memory
is `chunk_size * vocab` floats in both passes.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

LogitsFn = Callable[[jax.Array, jax.Array | None], jax.Array]  # (h [b, t, d], adapter [b] | None) -> f32 [b, t, v]


def logprobs_from_logits(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    logits_btv = logits_btv.astype(jnp.float32)
    target_logit_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return target_logit_bt - jax.nn.logsumexp(logits_btv, axis=-1)


def chunked_target_logprobs(
    logits_fn: LogitsFn,
    hidden_btd: jax.Array,
    targets_bt: jax.Array,
    adapter_b: jax.Array | None,
    chunk_size: int,
) -> jax.Array:
    """log p(targets[b, t] | hidden[b, t]) for every token, float32 [b, t].

    Chunks run along time, `max(1, chunk_size // b)` positions of every row at once (about
    `chunk_size` tokens), so each chunk keeps the per-row adapter of the batch."""
    b, t, d = hidden_btd.shape
    chunk = max(1, min(chunk_size // b, t))
    pad = -t % chunk
    chunks = (t + pad) // chunk
    h_cbkd = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, chunks, chunk, d).swapaxes(0, 1)
    t_cbk = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(args):
        h_bkd, tgt_bk = args
        return logprobs_from_logits(logits_fn(h_bkd, adapter_b), tgt_bk)

    logprobs_cbk = jax.lax.map(one_chunk, (h_cbkd, t_cbk))
    return logprobs_cbk.swapaxes(0, 1).reshape(b, chunks * chunk)[:, :t]
