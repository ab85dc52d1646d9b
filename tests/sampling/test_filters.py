"""Temperature / top-k / top-p / min-p selection on a small vocabulary, checked statistically with fixed seeds;
repetition penalty and min-p token sets against transformers' logits processors."""

import jax
import jax.numpy as jnp
import numpy as np

from tx.sampling.filters import (
    choose,
    filter_logits,
    first_argmax,
    mark_present,
    penalize,
    row_keys,
    sample_categorical,
    select_tokens,
)

PROBS = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
LOGITS = np.log(PROBS)


def _draw(n, temperature, top_k, top_p):
    logits = jnp.asarray(np.tile(LOGITS, (n, 1)), jnp.float32)
    keys = row_keys(jnp.arange(n, dtype=jnp.uint32), jnp.int32(0))
    full = lambda x: jnp.full(n, x)  # noqa: E731
    return np.asarray(select_tokens(logits, keys, full(temperature), full(top_k).astype(jnp.int32), full(top_p)))


def test_nucleus_and_top_k_support_and_frequencies():
    n = 20000
    # top_p = 0.6: 0.4 + 0.25 = 0.65 >= 0.6 -> nucleus {0, 1}, renormalised 0.615 / 0.385
    draws = _draw(n, 1.0, -1, 0.6)
    assert set(np.unique(draws)) == {0, 1}
    assert abs(np.mean(draws == 0) - 0.4 / 0.65) < 0.015
    # top_k = 3 -> {0, 1, 2} renormalised
    draws = _draw(n, 1.0, 3, 1.0)
    assert set(np.unique(draws)) == {0, 1, 2}
    np.testing.assert_allclose(np.bincount(draws, minlength=6)[:3] / n, PROBS[:3] / PROBS[:3].sum(), atol=0.015)
    # no filtering: the model distribution
    draws = _draw(n, 1.0, 0, 1.0)
    np.testing.assert_allclose(np.bincount(draws, minlength=6) / n, PROBS, atol=0.015)
    # temperature 0.5 sharpens to p^2 / sum p^2
    draws = _draw(n, 0.5, -1, 1.0)
    sharp = PROBS**2 / np.sum(PROBS**2)
    np.testing.assert_allclose(np.bincount(draws, minlength=6) / n, sharp, atol=0.015)


def test_two_level_draw_follows_the_distribution_across_blocks_and_skips_masked_tokens():
    """sample_categorical with blocks of 8 over a vocabulary of 45 (a partial last block): frequencies equal
    numpy's softmax (20,000 draws, 0.012), -inf entries and all-masked blocks never drawn, and a row's token
    is the same alone as in a batch."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=45).astype(np.float32) * 1.5
    logits[[0, 7, 8, 30, 44]] = -np.inf
    logits[16:24] = -np.inf  # a whole block masked
    probs = np.exp(logits - logits[np.isfinite(logits)].max())
    probs /= probs.sum()
    n = 20000
    keys = row_keys(jnp.arange(n, dtype=jnp.uint32), jnp.int32(0))
    draws = np.asarray(sample_categorical(keys, jnp.tile(jnp.asarray(logits), (n, 1)), block=8))
    assert np.all(np.isfinite(logits[draws]))
    np.testing.assert_allclose(np.bincount(draws, minlength=45) / n, probs, atol=0.012)
    # a single surviving token, at a block's last and at the vocabulary's last position
    for only in (15, 44):
        one = np.full(45, -np.inf, np.float32)
        one[only] = 0.0
        assert set(np.asarray(sample_categorical(keys[:200], jnp.tile(jnp.asarray(one), (200, 1)), block=8))) == {only}
    alone = [int(sample_categorical(keys[i:i + 1], jnp.asarray(logits)[None], block=8)[0]) for i in range(5)]
    assert alone == draws[:5].tolist()


def test_greedy_top_k_one_and_tiny_top_p():
    assert set(_draw(50, 0.0, -1, 1.0)) == {0}
    assert set(_draw(500, 2.0, 1, 1.0)) == {0}
    assert set(_draw(500, 1.0, -1, 1e-6)) == {0}  # the most likely token is always kept


def test_filter_mixes_rows():
    logits = jnp.asarray(np.tile(LOGITS, (2, 1)), jnp.float32)
    out = np.asarray(filter_logits(logits, jnp.array([1.0, 1.0]), jnp.array([2, -1]), jnp.array([1.0, 0.7])))
    # row 0: top-2; row 1: nucleus 0.7 needs 0.4 + 0.25 + 0.15 (mass before token 2 is 0.65 < 0.7)
    assert np.isfinite(out[0]).sum() == 2 and np.isfinite(out[1]).sum() == 3


# ---- repetition penalty and min-p, against transformers' logits processors (an independent reference) ----


def _hf_reference(logits, ids, temperature, top_k, top_p, min_p, penalty):
    """Row by row: transformers' processors in generate's order (penalty, temperature, top-k, top-p, min-p)."""
    import torch
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    rows = []
    for i in range(logits.shape[0]):
        x = torch.tensor(logits[i : i + 1])
        row_ids = torch.tensor(ids[i : i + 1])
        if penalty[i] != 1.0:
            x = RepetitionPenaltyLogitsProcessor(float(penalty[i]))(row_ids, x)
        x = TemperatureLogitsWarper(float(temperature[i]))(row_ids, x)
        if top_k[i] > 0:
            x = TopKLogitsWarper(int(top_k[i]))(row_ids, x)
        if top_p[i] < 1.0:
            x = TopPLogitsWarper(float(top_p[i]))(row_ids, x)
        if min_p[i] > 0:
            x = MinPLogitsWarper(float(min_p[i]))(row_ids, x)
        rows.append(x[0].numpy())
    return np.stack(rows)


def _mixed_rows(seed, b=12, vocab=64, n=10):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((b, vocab)) * 3).astype(np.float32)
    ids = rng.integers(0, vocab, (b, n))  # repeats included
    cycle = lambda *v: np.resize(np.asarray(v), b)  # noqa: E731
    temperature = cycle(1.0, 0.7, 1.5, 0.4, 2.0).astype(np.float32)
    top_k = cycle(-1, -1, 8, 0, 20, -1, 5).astype(np.int32)
    top_p = cycle(1.0, 0.9, 1.0, 1.0, 0.8, 0.95, 1.0, 0.5).astype(np.float32)
    min_p = cycle(0.0, 0.05, 0.2, 0.0, 0.1, 0.5, 1.0, 0.02, 0.3).astype(np.float32)
    penalty = cycle(1.0, 1.3, 0.7, 2.0, 1.0, 1.1).astype(np.float32)
    return logits, ids, temperature, top_k, top_p, min_p, penalty


def test_penalize_matches_transformers_repetition_penalty():
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits, ids, *_, penalty = _mixed_rows(0)
    presence = mark_present(jnp.zeros(logits.shape, bool), jnp.asarray(ids))
    got = np.asarray(penalize(jnp.asarray(logits), presence, jnp.asarray(penalty)))
    for i in range(len(logits)):
        want = RepetitionPenaltyLogitsProcessor(float(penalty[i]))(torch.tensor(ids[i : i + 1]),
                                                                   torch.tensor(logits[i : i + 1]))[0].numpy()
        np.testing.assert_allclose(got[i], want, rtol=1e-6)
    untouched = ~np.asarray(presence) | (penalty[:, None] == 1.0)
    np.testing.assert_array_equal(got[untouched], logits[untouched])


def test_mark_present_skips_invalid_ids():
    presence = mark_present(jnp.zeros((2, 8), bool), jnp.array([[1, 2, 0], [3, 0, 0]]),
                            jnp.array([[True, True, False], [True, False, False]]))
    assert [np.flatnonzero(r).tolist() for r in np.asarray(presence)] == [[1, 2], [3]]
    presence = mark_present(presence, jnp.array([5, 7]), jnp.array([True, False]))
    assert [np.flatnonzero(r).tolist() for r in np.asarray(presence)] == [[1, 2, 5], [3]]


def test_filters_with_min_p_keep_the_transformers_token_sets():
    logits, ids, temperature, top_k, top_p, min_p, penalty = _mixed_rows(1)
    presence = mark_present(jnp.zeros(logits.shape, bool), jnp.asarray(ids))
    chosen_from = penalize(jnp.asarray(logits), presence, jnp.asarray(penalty))
    got = np.asarray(filter_logits(chosen_from, jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p),
                                   jnp.asarray(min_p)))
    want = _hf_reference(logits, ids, temperature, top_k, top_p, min_p, penalty)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    kept = np.isfinite(got)
    np.testing.assert_allclose(got[kept], want[kept], rtol=1e-5)
    sizes = kept.sum(-1)
    assert sizes.min() == 1 and len(set(sizes.tolist())) > 5  # min_p = 1 keeps one token; sets vary by row
    # min-p alone (top-k / top-p off): same sets as transformers' MinPLogitsWarper
    off_k, off_p = np.full_like(top_k, -1), np.ones_like(top_p)
    alone = np.asarray(filter_logits(jnp.asarray(logits), jnp.asarray(temperature), jnp.asarray(off_k),
                                     jnp.asarray(off_p), jnp.asarray(min_p)))
    want = _hf_reference(logits, ids, temperature, off_k, off_p, min_p, np.ones_like(penalty))
    np.testing.assert_array_equal(np.isfinite(alone), np.isfinite(want))
    assert np.isfinite(alone[min_p == 0]).all()


def test_min_p_sampling_support_and_frequencies():
    n = 20000
    logits = jnp.asarray(np.tile(LOGITS, (n, 1)), jnp.float32)
    keys = row_keys(jnp.arange(n, dtype=jnp.uint32), jnp.int32(0))
    full = lambda x: jnp.full(n, x)  # noqa: E731
    # min_p = 0.3: threshold 0.3 * 0.4 = 0.12 -> {0, 1, 2} renormalised; rows alternate with min_p = 0 (off)
    min_p = jnp.where(jnp.arange(n) % 2 == 0, 0.3, 0.0)
    draws = np.asarray(select_tokens(logits, keys, full(1.0), full(-1), full(1.0), min_p))
    on, off = draws[::2], draws[1::2]
    assert set(np.unique(on)) == {0, 1, 2}
    np.testing.assert_allclose(np.bincount(on, minlength=6)[:3] / len(on), PROBS[:3] / PROBS[:3].sum(), atol=0.02)
    np.testing.assert_allclose(np.bincount(off, minlength=6) / len(off), PROBS, atol=0.02)
    # after temperature 0.5 (p^2): 0.06^2 / 0.4^2 = 0.0225 < 0.03 <= 0.1^2 / 0.4^2 -> {0, 1, 2, 3}
    draws = np.asarray(select_tokens(logits, keys, full(0.5), full(-1), full(1.0), full(0.03)))
    assert set(np.unique(draws)) == {0, 1, 2, 3}


def test_choose_penalizes_the_choice_not_the_logprobs():
    logits, ids, temperature, top_k, top_p, min_p, penalty = _mixed_rows(2)
    presence = mark_present(jnp.zeros(logits.shape, bool), jnp.asarray(ids))
    greedy = np.zeros_like(temperature)
    keys = row_keys(jnp.arange(len(logits), dtype=jnp.uint32), jnp.int32(3))
    token, logprob, top = choose(jnp.asarray(logits), keys, jnp.asarray(greedy), jnp.asarray(top_k),
                                 jnp.asarray(top_p), 4, min_p_b=jnp.asarray(min_p), penalty_b=jnp.asarray(penalty),
                                 presence_bv=presence)
    want = _hf_reference(logits, ids, np.ones_like(temperature), np.full_like(top_k, -1), np.ones_like(top_p),
                         np.zeros_like(min_p), penalty).argmax(-1)
    np.testing.assert_array_equal(np.asarray(token), want)
    assert (want != logits.argmax(-1)).any()  # the penalty changed some choices
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(np.asarray(logprob), raw[np.arange(len(raw)), want], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(top[0]), np.argsort(-raw, axis=-1)[:, :4])
    # sampled rows: every token inside its row's filtered set
    token, logprob, _ = choose(jnp.asarray(logits), keys, jnp.asarray(temperature), jnp.asarray(top_k),
                               jnp.asarray(top_p), 0, min_p_b=jnp.asarray(min_p), penalty_b=jnp.asarray(penalty),
                               presence_bv=presence)
    allowed = np.isfinite(_hf_reference(logits, ids, temperature, top_k, top_p, min_p, penalty))
    assert allowed[np.arange(len(allowed)), np.asarray(token)].all()
    np.testing.assert_allclose(np.asarray(logprob), raw[np.arange(len(raw)), np.asarray(token)], rtol=1e-6)


def test_first_argmax_is_numpys_argmax_with_ties_and_infinities():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((6, 3000)).astype(np.float32)
    logits[1, [5, 17, 2999]] = 9.0  # a tie: the first index wins
    logits[2, :] = -np.inf
    logits[2, 123] = 0.0
    logits[3, :] = 1.5  # all equal
    logits[4, 2999] = np.inf
    logits[5] = np.round(logits[5])  # many ties at the maximum
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, logits.argmax(-1))
    assert got.dtype == np.int32
