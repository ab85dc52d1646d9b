"""Prefill + on-device decode loop with a KV cache, for rows of different adapters and parameters.

Shapes are static per (rows, prompt bucket, new-token bucket, stop-list bucket); every parameter value
(max_tokens within the bucket, temperature, top-k, top-p, min-p, repetition penalty, seeds, stop tokens) is a
traced array, so changing them never recompiles. The loop exits as soon as every row has stopped.

Repetition penalty: the loop carries each row's token presence, bool `[b, vocab]`, marked from the prompt and
then with every sampled token (`tx.sampling.filters.penalize` / `mark_present`).

Returned log-probs are float32 `log_softmax` of the model's unscaled distribution (temperature 1, no
penalty, no top-k / top-p / min-p filtering) at each step, i.e. exactly what `forward` gives for the same
tokens; this is the denominator RL importance ratios need.

`topk_sample_logprobs` (SDK >= 0.32: "the top-k logprobs for each sampled token", SampledSequence.topk_logprobs
up to k (id, log-prob) pairs per generated position) come from that same unscaled distribution, so the
sampled token's own log-prob and its top-k row agree; `lax.top_k` reads the [b, vocab] log-softmax the step
already holds, adding only [b, k] per step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tx.sampling.filters import choose, mark_present, row_keys


class DecodeInputs(NamedTuple):
    prompt_bt: jax.Array  # int32 [b, p], right-padded
    prompt_len_b: jax.Array  # int32 [b] (>= 1 for real rows)
    adapter_b: jax.Array  # int32 [b]
    max_tokens_b: jax.Array  # int32 [b]
    temperature_b: jax.Array  # float32 [b]
    top_k_b: jax.Array  # int32 [b]
    top_p_b: jax.Array  # float32 [b]
    min_p_b: jax.Array  # float32 [b], 0 = off
    repetition_penalty_b: jax.Array  # float32 [b], 1 = off
    seed_b: jax.Array  # uint32 [b]
    stop_bs: jax.Array  # int32 [b, s], -1 = unused


class DecodeOutputs(NamedTuple):
    tokens_bn: jax.Array  # int32 [b, max_new]
    logprobs_bn: jax.Array  # float32 [b, max_new]
    length_b: jax.Array  # int32 [b]: tokens generated, stop token included
    stopped_b: jax.Array  # bool [b]: ended on a stop token (else: length)
    top_ids_bnk: jax.Array | None  # int32 [b, max_new, k] with topk > 0
    top_logprobs_bnk: jax.Array | None  # float32 [b, max_new, k]


def last_token_logits(model, hidden_btd: jax.Array, length_b: jax.Array, adapter_b: jax.Array) -> jax.Array:
    last_bd = jnp.take_along_axis(hidden_btd, (length_b - 1)[:, None, None], axis=1)[:, 0]
    return model.logits(last_bd[:, None, :], adapter_b)[:, 0]


def generate(model, inp: DecodeInputs, max_new: int, topk: int = 0) -> DecodeOutputs:
    """Sample up to `max_new` (static) and each row's `max_tokens` new tokens per row; with `topk` (static)
    > 0, also the top-k (id, log-prob) pairs of every step."""
    b, p = inp.prompt_bt.shape
    mask_bt = jnp.arange(p)[None, :] < inp.prompt_len_b[:, None]
    hidden_btd, kvs = model.prefill(inp.prompt_bt, mask_bt.astype(jnp.int32), inp.adapter_b)
    pad = [(0, 0), (0, 0), (0, max_new), (0, 0), (0, 0)]  # [L, b, p + max_new, kv, d]
    caches = [(jnp.pad(k, pad), jnp.pad(v, pad)) for k, v in kvs]
    logits_bv = last_token_logits(model, hidden_btd, inp.prompt_len_b, inp.adapter_b)
    presence_bv = mark_present(jnp.zeros(logits_bv.shape, bool), inp.prompt_bt, mask_bt)

    def cond(state):
        step, done_b = state[0], state[7]
        return (step < max_new) & ~jnp.all(done_b)

    def body(state):
        step, logits_bv, presence_bv, caches, tokens_bn, logprobs_bn, length_b, done_b, *top = state
        token_b, logprob_b, chosen_top = choose(logits_bv, row_keys(inp.seed_b, step), inp.temperature_b, inp.top_k_b,
                                                inp.top_p_b, topk, min_p_b=inp.min_p_b,
                                                penalty_b=inp.repetition_penalty_b, presence_bv=presence_bv)
        active_b = ~done_b
        presence_bv = mark_present(presence_bv, token_b, active_b)
        if topk:
            top = [top[0].at[:, step].set(chosen_top[0]), top[1].at[:, step].set(chosen_top[1])]
        tokens_bn = tokens_bn.at[:, step].set(jnp.where(active_b, token_b, 0))
        logprobs_bn = logprobs_bn.at[:, step].set(jnp.where(active_b, logprob_b, 0.0))
        length_b = length_b + active_b
        hit_stop_b = jnp.any(inp.stop_bs == token_b[:, None], axis=-1)
        done_b = done_b | (active_b & (hit_stop_b | (length_b >= inp.max_tokens_b)))
        hidden_bd, caches = model.decode_step(token_b, inp.prompt_len_b + step, caches, inp.adapter_b)
        logits_bv = model.logits(hidden_bd[:, None, :], inp.adapter_b)[:, 0]
        return step + 1, logits_bv, presence_bv, caches, tokens_bn, logprobs_bn, length_b, done_b, *top

    state = (
        jnp.int32(0),
        logits_bv,
        presence_bv,
        caches,
        jnp.zeros((b, max_new), jnp.int32),
        jnp.zeros((b, max_new), jnp.float32),
        jnp.zeros(b, jnp.int32),
        inp.max_tokens_b <= 0,
    )
    if topk:
        state += (jnp.zeros((b, max_new, topk), jnp.int32), jnp.zeros((b, max_new, topk), jnp.float32))
    _, _, _, _, tokens_bn, logprobs_bn, length_b, _, *top = jax.lax.while_loop(cond, body, state)
    last_b = jnp.take_along_axis(tokens_bn, jnp.maximum(length_b - 1, 0)[:, None], axis=-1)[:, 0]
    stopped_b = (length_b > 0) & jnp.any(inp.stop_bs == last_b[:, None], axis=-1)
    return DecodeOutputs(tokens_bn, logprobs_bn, length_b, stopped_b, *(top or (None, None)))
