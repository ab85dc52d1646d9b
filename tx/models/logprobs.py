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
    """log p(target) with `targets` shaped [b, t] or [b, t, K] (K targets per position: one logsumexp
    per position, then a gather of K values)."""
    logits_btv = logits_btv.astype(jnp.float32)
    lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    if targets_bt.ndim == logits_btv.ndim - 1:
        return jnp.take_along_axis(logits_btv, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0] - lse_bt
    return jnp.take_along_axis(logits_btv, targets_bt.astype(jnp.int32), axis=-1) - lse_bt[..., None]


def entropy_from_logits(logits_btv: jax.Array) -> jax.Array:
    """Entropy of softmax(logits) per position, float32: logsumexp(z) - sum softmax(z) * z."""
    logits_btv = logits_btv.astype(jnp.float32)
    lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
    probs_btv = jnp.exp(logits_btv - lse_bt[..., None])
    return lse_bt - jnp.sum(probs_btv * logits_btv, axis=-1)


def chunked_target_logprobs(
    logits_fn: LogitsFn,
    hidden_btd: jax.Array,
    targets_bt: jax.Array,
    adapter_b: jax.Array | None,
    chunk_size: int,
    with_entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """log p(targets[b, t] | hidden[b, t]) for every token, float32 [b, t] (or [b, t, K] for targets
    [b, t, K]); with `with_entropy`, also the entropy of every position's distribution [b, t]
    (differentiable, computed from the same chunk of logits)."""
    target, _, _, entropy = chunked_logprob_stats(logits_fn, hidden_btd, targets_bt, adapter_b, chunk_size,
                                                  with_entropy=with_entropy)
    return (target, entropy) if with_entropy else target


def chunked_logprob_stats(
    logits_fn: LogitsFn,
    hidden_btd: jax.Array,
    targets_bt: jax.Array,
    adapter_b: jax.Array | None,
    chunk_size: int,
    top_k: int = 0,
    with_entropy: bool = False,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array | None]:
    """Target log-probs [b, t]; if `top_k` > 0, the top-k token ids and log-probs [b, t, k]; if
    `with_entropy`, each position's entropy [b, t] (else None).

    Chunks run along time, `max(1, chunk_size // b)` positions of every row at once (about
    `chunk_size` tokens), so each chunk keeps the per-row adapter of the batch."""
    b, t, d = hidden_btd.shape
    chunk = max(1, min(chunk_size // b, t))
    pad = -t % chunk
    chunks = (t + pad) // chunk
    h_cbkd = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, chunks, chunk, d).swapaxes(0, 1)
    extra = targets_bt.shape[2:]  # K target columns, if any
    t_cbk = jnp.pad(targets_bt, ((0, 0), (0, pad)) + ((0, 0),) * len(extra)).reshape(
        b, chunks, chunk, *extra).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(args):
        h_bkd, tgt_bk = args
        logits_bkv = logits_fn(h_bkd, adapter_b)
        target_bk = logprobs_from_logits(logits_bkv, tgt_bk)
        entropy_bk = entropy_from_logits(logits_bkv) if with_entropy else None
        if not top_k:
            return target_bk, None, None, entropy_bk
        top_lp_bkj, top_ids_bkj = jax.lax.top_k(jax.nn.log_softmax(logits_bkv, axis=-1), top_k)
        return target_bk, top_ids_bkj.astype(jnp.int32), top_lp_bkj, entropy_bk

    def unchunk(x):
        return None if x is None else x.swapaxes(0, 1).reshape(b, chunks * chunk, *x.shape[3:])[:, :t]

    return tuple(unchunk(x) for x in jax.lax.map(one_chunk, (h_cbkd, t_cbk)))
