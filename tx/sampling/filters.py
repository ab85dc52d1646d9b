"""Per-row next-token selection: temperature, top-k, top-p (nucleus), seeded, all as traced values.

Every parameter is a per-row array, so a batch mixes parameters freely and changing their values never
recompiles. Randomness comes from `key(seed_b)` folded with the step number only, so a row's tokens do not
depend on the rest of the batch or on padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_keys(seed_b: jax.Array, step: jax.Array) -> jax.Array:
    """One PRNG key per row for this decode step."""
    return jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), step))(seed_b.astype(jnp.uint32))


def filter_logits(logits_bv: jax.Array, temperature_b: jax.Array, top_k_b: jax.Array, top_p_b: jax.Array) -> jax.Array:
    """Temperature-scaled logits with tokens outside the top-k and the top-p nucleus set to -inf.

    top_k <= 0 means no top-k; top_p = 1 keeps everything. The nucleus is the smallest set of the most
    likely tokens (after top-k) whose probability reaches top_p; the most likely token is always kept."""
    vocab = logits_bv.shape[-1]
    scaled_bv = logits_bv.astype(jnp.float32) / jnp.maximum(temperature_b, 1e-6)[:, None]
    sorted_bv = -jnp.sort(-scaled_bv, axis=-1)  # descending
    k_b = jnp.where(top_k_b > 0, jnp.minimum(top_k_b, vocab), vocab)
    in_top_k_bv = jnp.arange(vocab)[None, :] < k_b[:, None]
    probs_bv = jax.nn.softmax(jnp.where(in_top_k_bv, sorted_bv, -jnp.inf), axis=-1)
    before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv  # mass strictly above each sorted token
    keep_bv = in_top_k_bv & (before_bv < top_p_b[:, None])
    keep_bv = keep_bv.at[:, 0].set(True)
    kept_b = jnp.sum(keep_bv, axis=-1)
    threshold_b = jnp.take_along_axis(sorted_bv, (kept_b - 1)[:, None], axis=-1)
    return jnp.where(scaled_bv >= threshold_b, scaled_bv, -jnp.inf)


def select_tokens(
    logits_bv: jax.Array,
    keys_b: jax.Array,
    temperature_b: jax.Array,
    top_k_b: jax.Array,
    top_p_b: jax.Array,
) -> jax.Array:
    """Next token per row: argmax where temperature == 0, else a sample of the filtered distribution."""
    greedy_b = jnp.argmax(logits_bv, axis=-1)
    filtering = jnp.any(top_k_b > 0) | jnp.any(top_p_b < 1.0)  # skip the vocab sort when nobody filters
    filtered_bv = jax.lax.cond(
        filtering,
        lambda: filter_logits(logits_bv, temperature_b, top_k_b, top_p_b),
        lambda: logits_bv.astype(jnp.float32) / jnp.maximum(temperature_b, 1e-6)[:, None],
    )
    sampled_b = jax.vmap(jax.random.categorical)(keys_b, filtered_bv)
    return jnp.where(temperature_b > 0, sampled_b, greedy_b).astype(jnp.int32)


def choose(logits_bv: jax.Array, keys_b: jax.Array, temperature_b: jax.Array, top_k_b: jax.Array, top_p_b: jax.Array,
           topk: int) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array] | None]:
    """(next token [b], its float32 log-prob under the unscaled distribution [b], and with `topk` > 0 the
    (ids, log-probs) `[b, topk]` of that distribution's most likely tokens): one decode step's choice."""
    token_b = select_tokens(logits_bv, keys_b, temperature_b, top_k_b, top_p_b)
    logsoftmax_bv = jax.nn.log_softmax(logits_bv.astype(jnp.float32), axis=-1)
    logprob_b = jnp.take_along_axis(logsoftmax_bv, token_b[:, None], axis=-1)[:, 0]
    top = None
    if topk:
        top_lp_bk, top_ids_bk = jax.lax.top_k(logsoftmax_bv, topk)
        top = (top_ids_bk.astype(jnp.int32), top_lp_bk)
    return token_b, logprob_b, top
