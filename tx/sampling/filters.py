"""Per-row next-token selection: repetition penalty, temperature, top-k, top-p (nucleus), min-p, seeded, all as
traced values.

Every parameter is a per-row array, so a batch mixes parameters freely and changing their values never
recompiles. Randomness comes from `key(seed_b)` folded with the step number only, so a row's tokens do not
depend on the rest of the batch or on padding.

Order (as transformers' generate): repetition penalty on the raw logits -> temperature -> top-k -> top-p ->
min-p; greedy rows (temperature 0) take the argmax of the penalized logits. Min-p compares each token with
the most likely one, which top-k / top-p always keep, so its kept set does not depend on the filters before
it. Work no row needs (the vocab sort of top-k / top-p, the min-p pass, the penalty pass) is skipped with
`lax.cond` on the batch's values, not on shapes, so it never recompiles either.

Only the token *choice* sees the penalty and the filters: the log-probs `choose` returns are always the
`log_softmax` of the raw logits (what `forward` gives).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_keys(seed_b: jax.Array, step: jax.Array) -> jax.Array:
    """One PRNG key per row for this decode step."""
    return jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), step))(seed_b.astype(jnp.uint32))


def penalize(logits_bv: jax.Array, presence_bv: jax.Array, penalty_b: jax.Array) -> jax.Array:
    """Repetition penalty (HF / vLLM): a token present in the row (prompt or generated so far) gets logit / r if
    its logit is > 0, else logit * r. `presence_bv` bool [b, vocab]; r = `penalty_b` [b] (> 0; 1 = off).
    Returns float32 logits."""
    x_bv = logits_bv.astype(jnp.float32)
    r_b1 = penalty_b.astype(jnp.float32)[:, None]
    penalized_bv = jnp.where(x_bv > 0, x_bv / r_b1, x_bv * r_b1)
    return jnp.where(presence_bv.astype(bool) & (r_b1 != 1.0), penalized_bv, x_bv)


def mark_present(presence_bv: jax.Array, ids_bn: jax.Array, valid_bn: jax.Array | None = None) -> jax.Array:
    """`presence_bv` with `ids_bn` [b, n] (or [b]) marked present in their rows; ids where `valid_bn` is False
    are left out."""
    ids_bn = ids_bn if ids_bn.ndim == 2 else ids_bn[:, None]
    if valid_bn is not None:
        valid_bn = valid_bn if valid_bn.ndim == 2 else valid_bn[:, None]
        ids_bn = jnp.where(valid_bn, ids_bn, presence_bv.shape[-1])  # out of range: dropped
    rows_b1 = jnp.arange(presence_bv.shape[0])[:, None]
    return presence_bv.at[rows_b1, ids_bn].set(True, mode="drop")


def apply_min_p(scaled_bv: jax.Array, min_p_b: jax.Array) -> jax.Array:
    """Tokens whose probability is below min_p * (the most likely token's probability) set to -inf; min_p <= 0
    keeps everything and the most likely token is always kept. Probabilities are those of `scaled_bv` (logits
    after temperature); ratios to the maximum do not change when -inf entries are renormalised away."""
    max_b1 = jnp.max(scaled_bv, axis=-1, keepdims=True)
    m_b1 = min_p_b.astype(jnp.float32)[:, None]
    keep_bv = (m_b1 <= 0) | (scaled_bv == max_b1) | (jnp.exp(scaled_bv - max_b1) >= m_b1)
    return jnp.where(keep_bv, scaled_bv, -jnp.inf)


def filter_logits(logits_bv: jax.Array, temperature_b: jax.Array, top_k_b: jax.Array, top_p_b: jax.Array,
                  min_p_b: jax.Array | None = None) -> jax.Array:
    """Temperature-scaled logits with tokens outside the top-k, the top-p nucleus and (given `min_p_b`) the
    min-p set at -inf.

    top_k <= 0 means no top-k; top_p = 1 keeps everything; min_p = 0 keeps everything. The nucleus is the
    smallest set of the most likely tokens (after top-k) whose probability reaches top_p; the most likely token
    is always kept. Min-p comes last (see `apply_min_p`)."""
    vocab = logits_bv.shape[-1]
    scaled_bv = logits_bv.astype(jnp.float32) / jnp.maximum(temperature_b, 1e-6)[:, None]
    sorted_bv = -jnp.sort(-scaled_bv, axis=-1)  # descending
    k_b = jnp.where(top_k_b > 0, jnp.minimum(top_k_b, vocab), vocab)
    in_top_k_bv = jnp.arange(vocab)[None, :] < k_b[:, None]
    probs_bv = jax.nn.softmax(jnp.where(in_top_k_bv, sorted_bv, -jnp.inf), axis=-1)
    before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv  # mass strictly above each sorted token
    # top_p >= 1 keeps all: the float32 cumsum can round up to 1 before the least likely tokens
    keep_bv = in_top_k_bv & ((before_bv < top_p_b[:, None]) | (top_p_b[:, None] >= 1.0))
    keep_bv = keep_bv.at[:, 0].set(True)
    kept_b = jnp.sum(keep_bv, axis=-1)
    threshold_b = jnp.take_along_axis(sorted_bv, (kept_b - 1)[:, None], axis=-1)
    filtered_bv = jnp.where(scaled_bv >= threshold_b, scaled_bv, -jnp.inf)
    return filtered_bv if min_p_b is None else apply_min_p(filtered_bv, min_p_b)


def first_argmax(logits_bv: jax.Array) -> jax.Array:
    """int32 [b]: the first index of each row's maximum (as `jnp.argmax`), as two single-operand reductions
    (max, then min over the indices that reach it), which XLA vectorises; argmax's (value, index) pair
    reduction does not."""
    vocab = logits_bv.shape[-1]
    max_b1 = jnp.max(logits_bv, axis=-1, keepdims=True)
    first_b = jnp.min(jnp.where(logits_bv == max_b1, jnp.arange(vocab, dtype=jnp.int32)[None, :], vocab), axis=-1)
    return jnp.where(first_b < vocab, first_b, 0)  # a NaN row has no maximum: token 0


SAMPLE_BLOCK = 1024  # vocabulary entries per block of `sample_categorical`


def sample_categorical(keys_b: jax.Array, logits_bv: jax.Array, block: int = SAMPLE_BLOCK) -> jax.Array:
    """One token per row drawn from `softmax(logits_bv)` (-inf entries are never drawn) by inverting the
    CDF with one uniform per row, in two levels: a vocabulary block by the block sums' CDF, then a token by
    the chosen block's CDF (short cumulative sums, so little float32 rounding). Per-row keys: a row's draw
    does not depend on the batch. Costs about two passes over the logits; a Gumbel-max draw (jax.random.
    categorical) needs a random number per vocabulary entry, several times the whole decode step on CPU."""
    b, v = logits_bv.shape
    block = min(block, v)
    nb = -(-v // block)
    x_bv = logits_bv.astype(jnp.float32)
    p_bv = jnp.exp(x_bv - jnp.max(x_bv, axis=-1, keepdims=True))
    p_bnk = jnp.pad(p_bv, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
    sums_bn = jnp.sum(p_bnk, axis=-1)
    cdf_bn = jnp.cumsum(sums_bn, axis=-1)
    below = lambda total: jnp.nextafter(total, jnp.zeros_like(total))  # noqa: E731 - largest float < total
    u_b = jnp.minimum(jax.vmap(jax.random.uniform)(keys_b) * cdf_bn[:, -1], below(cdf_bn[:, -1]))
    block_b = jnp.sum(cdf_bn <= u_b[:, None], axis=-1)  # the first block whose CDF passes u (never an empty one)
    start_b = jnp.take_along_axis(cdf_bn - sums_bn, block_b[:, None], axis=-1)[:, 0]
    inner_bk = jnp.take_along_axis(p_bnk, block_b[:, None, None], axis=1)[:, 0]
    inner_cdf_bk = jnp.cumsum(inner_bk, axis=-1)
    rest_b = jnp.clip(u_b - start_b, 0.0, below(inner_cdf_bk[:, -1]))
    token_b = block_b * block + jnp.sum(inner_cdf_bk <= rest_b[:, None], axis=-1)
    return token_b.astype(jnp.int32)


def select_tokens(
    logits_bv: jax.Array,
    keys_b: jax.Array,
    temperature_b: jax.Array,
    top_k_b: jax.Array,
    top_p_b: jax.Array,
    min_p_b: jax.Array | None = None,
) -> jax.Array:
    """Next token per row: argmax where temperature == 0, else a sample of the filtered distribution.
    `logits_bv` are the logits to choose from (already penalized, if a penalty applies). A batch of greedy
    rows skips the sampling work (filters and the draw)."""
    greedy_b = first_argmax(logits_bv)

    def sample() -> jax.Array:
        filtering = jnp.any(top_k_b > 0) | jnp.any(top_p_b < 1.0)  # skip the vocab sort when nobody filters
        filtered_bv = jax.lax.cond(
            filtering,
            lambda: filter_logits(logits_bv, temperature_b, top_k_b, top_p_b),
            lambda: logits_bv.astype(jnp.float32) / jnp.maximum(temperature_b, 1e-6)[:, None],
        )
        if min_p_b is not None:
            filtered_bv = jax.lax.cond(jnp.any(min_p_b > 0), apply_min_p, lambda x, _: x, filtered_bv, min_p_b)
        return sample_categorical(keys_b, filtered_bv)

    sampled_b = jax.lax.cond(jnp.any(temperature_b > 0), sample, lambda: greedy_b)
    return jnp.where(temperature_b > 0, sampled_b, greedy_b)


def choose(logits_bv: jax.Array, keys_b: jax.Array, temperature_b: jax.Array, top_k_b: jax.Array, top_p_b: jax.Array,
           topk: int, min_p_b: jax.Array | None = None, penalty_b: jax.Array | None = None,
           presence_bv: jax.Array | None = None) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array] | None]:
    """(next token [b], its float32 log-prob under the unscaled distribution [b], and with `topk` > 0 the
    (ids, log-probs) `[b, topk]` of that distribution's most likely tokens): one decode step's choice.

    Optional per-row parameters (None = off for every row, no work): `min_p_b` float32 [b] (0 = off);
    `penalty_b` float32 [b] repetition penalty (1 = off) with `presence_bv` bool [b, vocab], the tokens of each
    row's prompt and of its generated tokens so far (`mark_present`). They change which token is chosen, never
    the log-probs returned (those of the raw logits)."""
    choose_from_bv = logits_bv
    if penalty_b is not None:
        if presence_bv is None:
            raise ValueError("a repetition penalty needs presence_bv")
        choose_from_bv = jax.lax.cond(jnp.any(penalty_b != 1.0), penalize,
                                      lambda x, *_: x.astype(jnp.float32), logits_bv, presence_bv, penalty_b)
    token_b = select_tokens(choose_from_bv, keys_b, temperature_b, top_k_b, top_p_b, min_p_b)
    logits_bv = logits_bv.astype(jnp.float32)
    # log_softmax's own arithmetic for the chosen token only: no [b, vocab] log-prob array
    max_b1 = jnp.max(logits_bv, axis=-1, keepdims=True)
    log_sum_b = jnp.log(jnp.sum(jnp.exp(logits_bv - max_b1), axis=-1))
    chosen_b = jnp.take_along_axis(logits_bv, token_b[:, None], axis=-1)[:, 0]
    logprob_b = (chosen_b - max_b1[:, 0]) - log_sum_b
    top = None
    if topk:
        top_lp_bk, top_ids_bk = jax.lax.top_k(jax.nn.log_softmax(logits_bv, axis=-1), topk)
        top = (top_ids_bk.astype(jnp.int32), top_lp_bk)
    return token_b, logprob_b, top
