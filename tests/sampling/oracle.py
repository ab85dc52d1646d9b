"""The tests' sampling oracle: a row sampled one token at a time by the model's ordinary forward over the
whole sequence so far (no KV cache of any kind: O(t^2), fine for tiny models).

Each step takes the logits of the last real position and chooses the token with the functions the engine
uses (`tx.sampling.filters`): `choose` with the row's parameters and the key `row_keys(seed, step)` (step =
tokens generated so far), the repetition penalty over the tokens of the prompt and of the output so far
(`mark_present`). So a seeded row samples exactly the engine's tokens, and the log-probs are the same
unscaled ones (temperature 1, no penalty, no filter), as are the top-k (id, log-prob) pairs. A row ends on
one of its stop tokens (EOS included, as `validate` puts it there), at its max_tokens, or once its text
contains one of its stop strings (then cut at the stop, as the engine's answers are).

The sequence is right-padded to a power of two (a few programs); causal attention never lets a position
see the padding after it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tx import types
from tx.runtime import pow2
from tx.sampling.filters import choose, mark_present, row_keys
from tx.sampling.requests import SampleRow, truncate_at_stop_string, validate


@functools.partial(jax.jit, static_argnames=("graphdef", "topk"))
def _next_token(graphdef, state, ids_1t, length, adapter_1, step, seed_1, temperature_1, top_k_1, top_p_1, min_p_1,
                penalty_1, presence_1v, topk):
    """The token after the first `length` tokens of `ids_1t`: (token [1], its log-prob [1], top-k pairs or
    None, the presence with it marked). The model comes as `nnx.split`'s halves: a plain jit, which leaves
    the caller's model untouched (the engine's kept layer copies follow its arrays)."""
    model = nnx.merge(graphdef, state)
    mask_1t = (jnp.arange(ids_1t.shape[1]) < length).astype(jnp.int32)[None]
    hidden_1td = model(ids_1t, mask_1t, adapter_1)
    last_11d = jax.lax.dynamic_slice_in_dim(hidden_1td, length - 1, 1, axis=1)
    logits_1v = model.logits(last_11d, adapter_1)[:, 0]
    token_1, logprob_1, top = choose(logits_1v, row_keys(seed_1, step), temperature_1, top_k_1, top_p_1, topk,
                                     min_p_b=min_p_1, penalty_b=penalty_1, presence_bv=presence_1v)
    return token_1, logprob_1, top, mark_present(presence_1v, token_1)


def generate(model, row: SampleRow, decode_text=None) -> types.GeneratedSequence:
    """`row` (a validated row: prompt, adapter slot, parameters, seed, stop tokens and strings, max_tokens)
    sampled from `model`; stop strings need `decode_text`."""
    graphdef, state = nnx.split(model)
    prompt = [int(t) for t in row.prompt]
    k = row.options.topk_sample_logprobs
    width = max(16, pow2(len(prompt) + row.max_tokens))
    presence = mark_present(jnp.zeros((1, model.config.vocab_size), bool), jnp.asarray([prompt], jnp.int32))
    params = (np.asarray([row.seed], np.uint32), np.asarray([row.temperature], np.float32),
              np.asarray([row.top_k], np.int32), np.asarray([row.top_p], np.float32),
              np.asarray([row.min_p], np.float32), np.asarray([row.repetition_penalty], np.float32))
    tokens, logprobs, top, reason = [], [], [], "length"
    for step in range(row.max_tokens):
        ids = np.zeros((1, width), np.int32)
        ids[0, : len(prompt) + step] = prompt + tokens
        token, logprob, pairs, presence = _next_token(graphdef, state, ids, np.int32(len(prompt) + step),
                                                      np.asarray([row.adapter], np.int32), np.int32(step), *params,
                                                      presence, topk=k)
        tokens.append(int(token[0]))
        logprobs.append(float(logprob[0]))
        if k:
            top.append(list(zip(np.asarray(pairs[0][0]).tolist(), np.asarray(pairs[1][0]).tolist())))
        if tokens[-1] in row.stop_tokens:
            reason = "stop"
            break
        cut = truncate_at_stop_string(tokens, row.stop_strings, decode_text) if row.stop_strings else None
        if cut is not None:
            tokens, logprobs, top, reason = tokens[:cut], logprobs[:cut], top[:cut], "stop"
            break
    return types.GeneratedSequence(tokens=tokens, logprobs=logprobs, stop_reason=reason,
                                   topk_logprobs=top if k else None)


def sample(backend, batch: types.PreparedSampleBatch) -> dict[str, types.SampleOutput | types.ErrorResponse]:
    """Every request of `batch` (live models only, no sampler checkpoints, no prompt scores) through
    `generate` on `backend`'s model, its rows validated as the backend's sampler validates them."""
    def adapter_of(model_id: str, checkpoint_path: str) -> int:
        assert not checkpoint_path, "the oracle samples live models only"
        return backend.sample_slot(model_id)

    rows, errors = validate(batch, adapter_of, backend.sampler.limits())
    out: dict[str, types.SampleOutput | types.ErrorResponse] = {
        batch.request_batch_slices[r][0]: types.ErrorResponse(error=message) for r, message in errors.items()}
    decode_text = backend.sampler.decode_text
    for r, (request_id, *_) in enumerate(batch.request_batch_slices):
        if request_id not in out:
            out[request_id] = types.SampleOutput(sequences=[generate(backend.model, row, decode_text)
                                                            for row in rows if row.request_index == r])
    return out
