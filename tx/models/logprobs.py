"""Target-token log-probabilities in float32, computed over token chunks.

Training never materialises `[tokens, vocab]` logits: tokens are processed `chunk_size` at a time under
`lax.map`, and each chunk is rematerialised in the backward pass (`jax.checkpoint`), so peak logits memory
is `chunk_size * vocab` floats in both passes.

A frozen LM head (no LoRA on it, its weight not trained: LoRA training) needs no rematerialisation
(`frozen_head_target_logprobs`): the gradient of `log p(y | h) = (h W)_y - logsumexp(h W)` with respect to `h`
is `W[:, y] - E_p[W[:, v]]`, whose expectation is known in the forward pass, so the forward computes it
(`p W^T`, the matmul the backward would run) and the backward only gathers `W[:, y]`: two vocabulary-sized
matmuls per chunk instead of three (the recomputed logits), and no recomputed softmax.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

LogitsFn = Callable[[jax.Array, jax.Array | None], jax.Array]  # (h [b, t, d], adapter [b] | None) -> f32 [b, t, v]


def logprobs_from_logits(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """log p(target) with `targets` shaped [b, t] or [b, t, K] (K targets per position: one logsumexp
    per position, then a gather of K values)."""
    logits_btv = logits_btv.astype(jnp.float32)
    return _minus_lse(logits_btv, targets_bt, jax.nn.logsumexp(logits_btv, axis=-1, keepdims=True))


def _minus_lse(logits_btv: jax.Array, targets_bt: jax.Array, lse_bt1: jax.Array) -> jax.Array:
    """The targets' logits minus logsumexp `lse_bt1` [b, t, 1]: [b, t] for targets [b, t], else [b, t, K]."""
    one = targets_bt.ndim == logits_btv.ndim - 1
    idx = (targets_bt[..., None] if one else targets_bt).astype(jnp.int32)
    out = jnp.take_along_axis(logits_btv, idx, axis=-1) - lse_bt1
    return out[..., 0] if one else out


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
    b, t, _ = hidden_btd.shape
    h_cbkd, t_cbk = _to_chunks(hidden_btd, chunk_size), _to_chunks(targets_bt, chunk_size)

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

    return tuple(None if x is None else _from_chunks(x, t) for x in jax.lax.map(one_chunk, (h_cbkd, t_cbk)))


def _chunk_len(b: int, t: int, chunk_size: int) -> int:
    """Positions of every row per chunk: about `chunk_size` tokens, each chunk keeps the batch's rows."""
    return max(1, min(chunk_size // b, t))


def _to_chunks(x_bt: jax.Array, chunk_size: int) -> jax.Array:
    """`[b, t, ...]` -> `[chunks, b, k, ...]`, time padded to a whole number of chunks."""
    b, t = x_bt.shape[:2]
    k = _chunk_len(b, t, chunk_size)
    pad = -t % k
    x_bt = jnp.pad(x_bt, ((0, 0), (0, pad)) + ((0, 0),) * (x_bt.ndim - 2))
    return x_bt.reshape(b, (t + pad) // k, k, *x_bt.shape[2:]).swapaxes(0, 1)


def _from_chunks(x_cbk: jax.Array, t: int) -> jax.Array:
    """`[chunks, b, k, ...]` -> `[b, t, ...]` (the padding dropped)."""
    chunks, b, k = x_cbk.shape[:3]
    return x_cbk.swapaxes(0, 1).reshape(b, chunks * k, *x_cbk.shape[3:])[:, :t]


def _head_logits(h_bkd: jax.Array, w_dv: jax.Array, temperature_b: jax.Array | None) -> jax.Array:
    logits_bkv = jnp.dot(h_bkd, w_dv, preferred_element_type=jnp.float32)
    return logits_bkv if temperature_b is None else logits_bkv / temperature_b.astype(jnp.float32)[:, None, None]


def _plain_head_logprobs(hidden_btd, w_dv, targets_bt, temperature_b, chunk_size: int) -> jax.Array:
    """`chunked_target_logprobs` of the logits `h W / T` (differentiable in every input by rematerialisation)."""
    return chunked_target_logprobs(lambda h, _: _head_logits(h, w_dv, temperature_b), hidden_btd, targets_bt,
                                   None, chunk_size)


def frozen_head_target_logprobs(
    hidden_btd: jax.Array,
    w_dv: jax.Array,
    targets_bt: jax.Array,
    temperature_b: jax.Array | None,
    chunk_size: int,
) -> jax.Array:
    """float32 log p(targets) of the logits `hidden W / temperature` [b, t] (or [b, t, K] for K targets per
    position), `chunk_size` tokens at a time; equal to `chunked_target_logprobs` of those logits.

    Differentiated with respect to `hidden` only (W and the temperature not trained), the forward pass also
    computes each position's `E_p[W[:, v]] / T` (float32 `[b, t, d]`, the size of the hidden states) and the
    backward pass is a gather of the targets' columns of W: one vocabulary matmul fewer than rematerialising
    (at bench_peer's ~100M shape, vocabulary 32k, a third of the LM head's matmuls). Where W or the
    temperature is differentiated (full fine-tuning), it runs `chunked_target_logprobs`' rematerialising pass."""
    return _frozen_head(chunk_size, hidden_btd.dtype)(hidden_btd, w_dv, targets_bt, temperature_b)


def _frozen_head(chunk_size: int, h_dtype: Any):
    """The custom-VJP function for one (static) chunk size and hidden-state dtype."""

    @jax.custom_vjp
    def logprobs(hidden_btd, w_dv, targets_bt, temperature_b):
        return _plain_head_logprobs(hidden_btd, w_dv, targets_bt, temperature_b, chunk_size)

    def fwd(hidden_btd, w_dv, targets_bt, temperature_b):
        h, w, tgt = hidden_btd.value, w_dv.value, targets_bt.value
        temp = None if temperature_b is None else temperature_b.value
        if w_dv.perturbed or (temp is not None and temperature_b.perturbed):
            out, vjp = jax.vjp(lambda h_, w_, t_: _plain_head_logprobs(h_, w_, tgt, t_, chunk_size), h, w, temp)
            return out, {"vjp": vjp}
        b, t, _ = h.shape

        def one_chunk(args):
            h_bkd, tgt_bk = args
            logits_bkv = _head_logits(h_bkd, w, temp)
            # one exp over the chunk serves the logsumexp and the expectation: E_p[W] = (e W^T) / sum(e)
            max_bk1 = jnp.max(logits_bkv, axis=-1, keepdims=True)
            exp_bkv = jnp.exp(logits_bkv - max_bk1)
            sum_bk1 = jnp.sum(exp_bkv, axis=-1, keepdims=True)
            target_bk = _minus_lse(logits_bkv, tgt_bk, max_bk1 + jnp.log(sum_bk1))
            # contracted as autodiff's transpose of the logits matmul would be (float32 x W's dtype)
            mean_w_bkd = jax.lax.dot_general(exp_bkv, w, (((2,), (1,)), ((), ())),
                                             preferred_element_type=jnp.float32) / sum_bk1
            return target_bk, mean_w_bkd

        target_cbk, mean_w_cbkd = jax.lax.map(one_chunk, (_to_chunks(h, chunk_size), _to_chunks(tgt, chunk_size)))
        return _from_chunks(target_cbk, t), {"mean_w": _from_chunks(mean_w_cbkd, t), "w": w, "targets": tgt,
                                             "temperature": temp}

    def bwd(res: dict[str, Any], g_bt):
        if isinstance(g_bt, SymbolicZero):
            return None, None, None, None
        if "vjp" in res:
            d_h, d_w, d_temp = res["vjp"](g_bt)
            return d_h, d_w, None, d_temp
        w_dv, tgt = res["w"], res["targets"]
        g_bt = g_bt.astype(jnp.float32)
        if res["temperature"] is not None:
            g_bt = g_bt / res["temperature"].astype(jnp.float32).reshape((-1,) + (1,) * (g_bt.ndim - 1))
        # the targets' columns of W, gathered along the vocabulary axis (no transposed copy of W); clipped: a
        # masked position's target may be anything, and its cotangent is 0 (a NaN fill would make it NaN)
        w_target_nd = jnp.take(w_dv, tgt.reshape(-1), axis=1, mode="clip").T.astype(jnp.float32)
        # K targets per position (K = 1 for [b, t] targets): sum_k g_k W[:, y_k] - (sum_k g_k) E_p[W]
        g_btk = g_bt.reshape(*tgt.shape[:2], -1)
        weighted_btd = (g_btk[..., None] * w_target_nd.reshape(*g_btk.shape, -1)).sum(axis=2)
        d_h = weighted_btd - g_btk.sum(axis=2)[..., None] * res["mean_w"]
        return d_h.astype(h_dtype), None, None, None

    logprobs.defvjp(fwd, bwd, symbolic_zeros=True)
    return logprobs
