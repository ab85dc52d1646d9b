"""Prompt scoring in one prefill: next-token log-probs, top-k, chosen ids' log-probs and draws, chunked.

Position t of a prompt predicts token t + 1, so every output is indexed by the predicting position: entry
[b, t] belongs to prompt position t + 1 (what the SDK calls row t of `target_prompt_logprobs` and of
`prompt_alt_tokens`). Log-probs are float32 log_softmax of the model's unscaled distribution (temperature
1, no top-k / top-p), as for sampled tokens (tx.sampling.filters.choose). Logits exist only `chunk` positions at a
time: [b, chunk, vocab], never [b, t, vocab].

prompt_alt_tokens_k (tinker 0.38 types/prompt_alt_tokens.py): k independent draws, with replacement, at
the request's temperature from the next-token distribution at every position (no top-k / top-p: the SDK
names the temperature only); temperature 0 draws the argmax k times. Each draw is reported with the
model's log-prob of it. Draws use the row's seed folded with ALT_STREAM and the position, a stream
apart from the decode loop's fold_in(seed, step), so they do not depend on the batch or on padding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

ALT_STREAM = 2**32 - 1  # never a decode step number


class PromptScoreInputs(NamedTuple):
    ids_bt: jax.Array  # int32 [b, t], right-padded
    mask_bt: jax.Array  # int32 [b, t]
    adapter_b: jax.Array  # int32 [b]
    target_ids_btm: jax.Array  # int32 [b, t, m]: ids to score at each position, -1 = none
    temperature_b: jax.Array  # float32 [b]
    seed_b: jax.Array  # uint32 [b]


class PromptScores(NamedTuple):
    next_bt: jax.Array  # float32 [b, t]: log p(prompt[t + 1] | prompt[: t + 1])
    top_ids_btk: jax.Array | None  # int32 [b, t, k]
    top_logprobs_btk: jax.Array | None  # float32 [b, t, k]
    target_btm: jax.Array | None  # float32 [b, t, m], 0.0 where the id was -1
    alt_ids_bta: jax.Array | None  # int32 [b, t, a]
    alt_logprobs_bta: jax.Array | None  # float32 [b, t, a]


def _draws(logits_bkv, seed_b, pos_k, temperature_b, count: int) -> jax.Array:
    """`count` draws per (row, position) at the row's temperature; argmax where the temperature is 0."""

    def keys(seed):
        base = jax.random.fold_in(jax.random.key(seed), ALT_STREAM)
        return jax.vmap(lambda p: jax.random.fold_in(base, p))(pos_k)

    keys_bk = jax.vmap(keys)(seed_b.astype(jnp.uint32))
    scaled_bkv = logits_bkv / jnp.maximum(temperature_b, 1e-6)[:, None, None]
    draw = jax.vmap(jax.vmap(lambda key, lv: jax.random.categorical(key, lv, shape=(count,))))
    drawn_bka = draw(keys_bk, scaled_bkv)
    greedy_bka = jnp.broadcast_to(jnp.argmax(logits_bkv, axis=-1)[..., None], drawn_bka.shape)
    return jnp.where(temperature_b[:, None, None] > 0, drawn_bka, greedy_bka).astype(jnp.int32)


def score_prompts(model, inp: PromptScoreInputs, chunk_size: int, top_k: int, alt_k: int) -> PromptScores:
    """All prompt scores of a batch in one prefill; `top_k`, `alt_k` (and m, the last axis of
    target_ids_btm) are static, 0 = not asked."""
    hidden_btd = model(inp.ids_bt, inp.mask_bt, inp.adapter_b)
    b, t, _ = hidden_btd.shape
    m = inp.target_ids_btm.shape[-1]
    chunk = max(1, min(chunk_size // b, t))
    pad = -t % chunk
    n = (t + pad) // chunk

    def chunks(x):  # [b, t, ...] -> [n, b, chunk, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(b, n, chunk, *x.shape[2:]).swapaxes(0, 1)

    pos_nk = jnp.arange(t + pad, dtype=jnp.int32).reshape(n, chunk)
    next_bt = jnp.roll(inp.ids_bt, -1, axis=1)

    def one_chunk(args):
        h_bkd, next_bk, tid_bkm, pos_k = args
        logits_bkv = model.logits(h_bkd, inp.adapter_b).astype(jnp.float32)
        lsm_bkv = jax.nn.log_softmax(logits_bkv, axis=-1)
        out = {"next": jnp.take_along_axis(lsm_bkv, next_bk[..., None], axis=-1)[..., 0]}
        if top_k:
            out["top_lp"], out["top_ids"] = jax.lax.top_k(lsm_bkv, top_k)
        if m:
            got_bkm = jnp.take_along_axis(lsm_bkv, jnp.maximum(tid_bkm, 0), axis=-1)
            out["target"] = jnp.where(tid_bkm >= 0, got_bkm, 0.0)
        if alt_k:
            out["alt_ids"] = _draws(logits_bkv, inp.seed_b, pos_k, inp.temperature_b, alt_k)
            out["alt_lp"] = jnp.take_along_axis(lsm_bkv, out["alt_ids"], axis=-1)
        return out

    out = jax.lax.map(one_chunk, (chunks(hidden_btd), chunks(next_bt), chunks(inp.target_ids_btm), pos_nk))

    def whole(name):  # [n, b, chunk, ...] -> [b, t, ...]
        if name not in out:
            return None
        x = out[name].swapaxes(0, 1)
        return x.reshape(b, n * chunk, *x.shape[3:])[:, :t]

    top_ids = whole("top_ids")
    return PromptScores(whole("next"), None if top_ids is None else top_ids.astype(jnp.int32), whole("top_lp"),
                        whole("target"), whole("alt_ids"), whole("alt_lp"))
