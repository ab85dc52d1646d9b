"""The sampling fields of SDK >= 0.32 through JaxBackend.sample, against transformers on the same checkpoint
(torch log_softmax / topk of the HF forward, base model and a PEFT LoRA adapter): topk_sample_logprobs,
target_prompt_logprobs (dense and sparse CSR), prompt_alt_tokens_k, prompt_logprobs_last_n. Tolerance:
1e-5 absolute on float32 log-probs. Also: the layout checks of target_prompt_logprobs, and bad values that
fail their own request only."""

import numpy as np
import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from transformers import AutoModelForCausalLM

import tx
from tests.helpers import peft_weights
from tx import types
from tx.models.adapters import set_adapter_weights
from tx.sampling.targets import plan

SP = types.SamplingParams
CONFIG = tx.JaxBackendConfig(max_lora_adapters=3, max_lora_rank=4, max_seq_len=64, max_num_samples=4,
                             max_target_prompt_logprobs=8, loss_chunk_size=8)  # small chunks: several per prompt
PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12]
ATOL = 1e-5


@pytest.fixture(scope="module")
def models(tiny_dirs):
    """(backend with adapter "a", {"": HF base model, "a": the same model under the PEFT adapter})."""
    backend = tx.JaxBackend(tiny_dirs["dense"], CONFIG)
    backend.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs["dense"], dtype=torch.float32)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_dirs["dense"], dtype=torch.float32),
                          PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"],
                                         init_lora_weights=False))
    set_adapter_weights(backend.model, backend.models["a"].adapter_index, peft_weights(peft), alpha=8, rank=4)
    return backend, {"": base, "a": peft}


def ref_logprobs(hf, tokens) -> np.ndarray:
    """[len(tokens), vocab]: torch log_softmax of the HF forward; row t is the distribution over token t + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


def batch(*requests):
    """requests: (request_id, model_id, prompt, params, num_samples, prompt_logprobs, topk, SampleOptions)."""
    prompts, params, models, slices, options = [], [], [], [], []
    for request_id, model_id, prompt, p, n, want_lp, topk, opts in requests:
        start = len(prompts)
        prompts += [list(prompt)] * n
        params += [p] * n
        models += [model_id] * n
        slices.append((request_id, model_id, start, len(prompts), want_lp, topk))
        options.append(opts)
    return types.PreparedSampleBatch(all_prompts=prompts, all_sampling_params=params, all_model_ids=models,
                                     all_checkpoint_ids=[""] * len(prompts), all_checkpoint_paths=[""] * len(prompts),
                                     request_batch_slices=slices, request_options=options)


def dense_targets(rows: int, cells: dict[tuple[int, int], int], cols: int) -> types.TargetPromptIds:
    ids = np.full((rows, cols), -1, np.int64)
    for (i, j), v in cells.items():
        ids[i, j] = v
    return types.TargetPromptIds(shape=(rows, cols), ids=ids.reshape(-1).tolist())


def sparse_targets(rows: int, cols: int, cells: dict[tuple[int, int], int]) -> types.TargetPromptIds:
    ordered = sorted(cells.items())
    crow = np.searchsorted([i for (i, _), _ in ordered], np.arange(rows + 1)).tolist()
    return types.TargetPromptIds(shape=(rows, cols), ids=[v for _, v in ordered], crow=crow,
                                 col=[j for (_, j), _ in ordered])


def test_prompt_fields_match_transformers(models):
    backend, hf = models
    n = len(PROMPT)
    dense = dense_targets(n - 1, {(0, 0): 3, (0, 2): 511, (4, 1): 0, (7, 0): 99, (7, 1): 100, (7, 2): 7}, cols=3)
    sparse = sparse_targets(n - 1, 26, {(2, 0): 17, (2, 25): 400, (6, 13): 12, (7, 3): -1, (7, 5): 8})
    greedy = SP(max_tokens=1, temperature=0.0, stop=[])
    warm = SP(max_tokens=1, temperature=1.0, seed=11, stop=[])
    out = backend.sample(batch(
        ("all", "a", PROMPT, warm, 2, True, 3, types.SampleOptions(target_prompt_logprobs=dense, prompt_alt_tokens_k=5)),
        ("sparse-last-n", "", PROMPT, greedy, 1, True, 2,
         types.SampleOptions(target_prompt_logprobs=sparse, prompt_logprobs_last_n=3, prompt_alt_tokens_k=4)),
        ("cold", "", PROMPT, SP(max_tokens=1, temperature=1e-3, seed=5, stop=[]), 1, False, 0,
         types.SampleOptions(prompt_alt_tokens_k=6)),
        ("plain", "a", PROMPT[:4], warm, 1, False, 0, types.SampleOptions()),
    ))
    ref = {m: ref_logprobs(model, PROMPT) for m, model in hf.items()}

    got = out["all"]
    assert len(got.sequences) == 2
    np.testing.assert_allclose(got.prompt_logprobs[1:], [ref["a"][t, PROMPT[t + 1]] for t in range(n - 1)], atol=ATOL)
    for t, row in enumerate(got.topk_prompt_logprobs[1:]):
        want = torch.topk(torch.tensor(ref["a"][t]), 3)
        assert [i for i, _ in row] == want.indices.tolist()
        np.testing.assert_allclose([v for _, v in row], want.values.numpy(), atol=ATOL)
    target = np.asarray(got.target_prompt_logprobs.logprobs).reshape(n - 1, 3)
    ids = np.asarray(dense.ids).reshape(n - 1, 3)
    want = np.where(ids >= 0, ref["a"][np.arange(n - 1)[:, None], np.maximum(ids, 0)], 0.0)
    np.testing.assert_allclose(target, want, atol=ATOL)
    assert got.target_prompt_logprobs.shape == (n - 1, 3) and got.target_prompt_logprobs.crow is None
    alt = np.asarray(got.prompt_alt_tokens)  # [n - 1, 5, 2]
    assert alt.shape == (n - 1, 5, 2)
    alt_ids = alt[..., 0].astype(int)
    np.testing.assert_allclose(alt[..., 1], ref["a"][np.arange(n - 1)[:, None], alt_ids], atol=ATOL)
    assert len(np.unique(alt_ids)) > 5  # draws at temperature 1 from a near-uniform tiny model vary

    got = out["sparse-last-n"]
    assert got.prompt_logprobs[: n - 3] == [None] * (n - 3)
    np.testing.assert_allclose(got.prompt_logprobs[n - 3:], [ref[""][t, PROMPT[t + 1]] for t in range(n - 4, n - 1)],
                               atol=ATOL)
    assert got.topk_prompt_logprobs[: n - 3] == [None] * (n - 3) and len(got.topk_prompt_logprobs) == n
    for t, row in zip(range(n - 4, n - 1), got.topk_prompt_logprobs[n - 3:]):
        assert [i for i, _ in row] == torch.topk(torch.tensor(ref[""][t]), 2).indices.tolist()
    tp = got.target_prompt_logprobs
    assert (tp.shape, tp.crow, tp.col) == (sparse.shape, sparse.crow, sparse.col)  # the request's layout
    rows = np.repeat(np.arange(n - 1), np.diff(sparse.crow))
    want = [0.0 if v == -1 else ref[""][r, v] for r, v in zip(rows, sparse.ids)]
    np.testing.assert_allclose(tp.logprobs, want, atol=ATOL)
    alt = np.asarray(got.prompt_alt_tokens)  # temperature 0: every draw is the argmax, on all rows (last_n
    assert alt.shape == (n - 1, 4, 2)       # does not apply to prompt_alt_tokens)
    np.testing.assert_array_equal(alt[..., 0], np.repeat(ref[""].argmax(-1)[: n - 1, None], 4, axis=1))

    # temperature 1e-3 > 0 scales the logits: the draws are the argmax too (unscaled, they would vary)
    alt = np.asarray(out["cold"].prompt_alt_tokens)
    np.testing.assert_array_equal(alt[..., 0], np.repeat(ref[""].argmax(-1)[: n - 1, None], 6, axis=1))
    assert out["cold"].prompt_logprobs is None and out["cold"].target_prompt_logprobs is None

    plain = out["plain"]
    assert plain.prompt_logprobs is None and plain.prompt_alt_tokens is None and plain.target_prompt_logprobs is None
    assert plain.sequences[0].topk_logprobs is None

    # the same seed draws the same alternatives, in any batch
    again = backend.sample(batch(("all", "a", PROMPT, warm, 1, False, 0, types.SampleOptions(prompt_alt_tokens_k=5))))
    same, first = np.asarray(again["all"].prompt_alt_tokens), np.asarray(out["all"].prompt_alt_tokens)
    np.testing.assert_array_equal(same[..., 0], first[..., 0])  # ids equal; log-probs to float32 rounding
    np.testing.assert_allclose(same[..., 1], first[..., 1], atol=ATOL)


def test_topk_sample_logprobs_match_transformers(models):
    backend, hf = models
    params = SP(max_tokens=7, temperature=1.0, seed=3, stop=[])
    out = backend.sample(batch(
        ("k4", "a", PROMPT[:5], params, 2, False, 0, types.SampleOptions(topk_sample_logprobs=4)),
        ("k1", "", PROMPT[:3], SP(max_tokens=5, temperature=0.0, stop=[]), 1, False, 0,
         types.SampleOptions(topk_sample_logprobs=1)),
        ("none", "", PROMPT[:3], params, 1, False, 0, types.SampleOptions()),
    ))
    for request_id, model_id, prompt, k in (("k4", "a", PROMPT[:5], 4), ("k1", "", PROMPT[:3], 1)):
        for seq in out[request_id].sequences:
            full = prompt + seq.tokens
            ref = ref_logprobs(hf[model_id], full)[len(prompt) - 1 : -1]  # the distributions the tokens came from
            assert len(seq.topk_logprobs) == len(seq.tokens) == len(ref)
            for step, (row, token) in enumerate(zip(seq.topk_logprobs, seq.tokens)):
                want = torch.topk(torch.tensor(ref[step]), k)
                assert [i for i, _ in row] == want.indices.tolist()
                np.testing.assert_allclose([v for _, v in row], want.values.numpy(), atol=ATOL)
                np.testing.assert_allclose(seq.logprobs[step], ref[step, token], atol=ATOL)
    assert all(row[0][0] == t for row, t in zip(out["k1"].sequences[0].topk_logprobs, out["k1"].sequences[0].tokens))
    assert out["none"].sequences[0].topk_logprobs is None


def test_topk_sample_logprobs_cut_with_stop_string(models):
    """A stop string cuts the top-k rows with the tokens they belong to (the same ids; the log-probs to 1e-6: the
    two requests may run different programs, whose sums XLA may order differently)."""
    backend, _ = models
    first = backend.sample(batch(("probe", "", PROMPT[:3], SP(max_tokens=6, temperature=0.0, stop=[]), 1, False, 0,
                                  types.SampleOptions(topk_sample_logprobs=2))))["probe"].sequences[0]
    text = backend.sampler.decode_text(first.tokens[:3])
    stop = text[-2:] if len(text) >= 2 else text
    cut = backend.sample(batch(("cut", "", PROMPT[:3], SP(max_tokens=6, temperature=0.0, stop=[stop]), 1, False, 0,
                                types.SampleOptions(topk_sample_logprobs=2))))["cut"].sequences[0]
    assert cut.stop_reason == "stop" and len(cut.tokens) <= 3
    want = first.topk_logprobs[: len(cut.tokens)]
    assert [[i for i, _ in row] for row in cut.topk_logprobs] == [[i for i, _ in row] for row in want]
    np.testing.assert_allclose([[lp for _, lp in row] for row in cut.topk_logprobs],
                               [[lp for _, lp in row] for row in want], rtol=0, atol=1e-6)


BAD = [
    (types.SampleOptions(topk_sample_logprobs=21), True, "topk_sample_logprobs = 21"),
    (types.SampleOptions(topk_sample_logprobs=-1), True, "topk_sample_logprobs = -1"),
    (types.SampleOptions(prompt_alt_tokens_k=10**9), True, "prompt_alt_tokens_k = 1000000000"),
    (types.SampleOptions(prompt_logprobs_last_n=0), True, "prompt_logprobs_last_n = 0"),
    (types.SampleOptions(prompt_logprobs_last_n=9), True, "prompt_logprobs_last_n = 9"),
    (types.SampleOptions(prompt_logprobs_last_n=2), False, "needs prompt_logprobs"),
    (types.SampleOptions(target_prompt_logprobs=dense_targets(7, {(0, 0): 1}, 1)), False, "needs len(prompt) - 1 = 8"),
    (types.SampleOptions(target_prompt_logprobs=dense_targets(8, {(3, 0): 512}, 1)), False,
     "target_prompt_logprobs[3, 0] = 512 is outside the vocabulary"),
    (types.SampleOptions(target_prompt_logprobs=dense_targets(8, {}, 2)), False, "names no token id"),
    (types.SampleOptions(target_prompt_logprobs=dense_targets(8, {(1, j): j for j in range(9)}, 9)), False,
     "names 9 ids at prompt position 2"),
]


@pytest.mark.parametrize("options,want_lp,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_fields_fail_their_request_only(models, options, want_lp, message):
    backend, _ = models
    ok = SP(max_tokens=2, temperature=0.0, stop=[])
    out = backend.sample(batch(("bad", "", PROMPT, ok, 1, want_lp, 0, options),
                               ("good", "", PROMPT, ok, 1, True, 0, types.SampleOptions(topk_sample_logprobs=2))))
    assert isinstance(out["bad"], types.ErrorResponse) and message in out["bad"].error, out["bad"]
    assert isinstance(out["good"], types.SampleOutput) and len(out["good"].sequences[0].topk_logprobs) == 2


LAYOUTS = [  # (shape, ids, crow, col), message
    (((2, 2), [1, 2, 3], None, None), "has 3 values; dense shape [2, 2] needs 4"),
    (((2, 2), [1, 2], [0, 1, 2], None), "must be sent together"),
    (((2, 2), [1, 2], [0, 2, 1], [0, 1]), "sparse_crow_indices must be 3 non-decreasing"),
    (((2, 2), [1, 2], [0, 1, 2], [0, 2]), "sparse_col_indices[1] = 2 is outside [0, 2)"),
    (((2, 2), [1, 2], [0, 1, 2], [0]), "sparse_col_indices has 1 entries for 2 values"),
    (((2, 2**40), [1], [0, 1, 1], [0]), "entries must be in [0, 2147483647]"),
    (((2, 2), [1, 2, -7, 4], None, None), "target_prompt_logprobs[1, 0] = -7 is outside the vocabulary"),
    (((2, 2), [1, 2, 10**30, 4], None, None), "data must be a list of 64-bit integers"),
]


@pytest.mark.parametrize("layout,message", LAYOUTS, ids=[m for _, m in LAYOUTS])
def test_target_layout_checks(layout, message):
    with pytest.raises(ValueError) as e:
        shape, ids, crow, col = layout
        plan(types.TargetPromptIds(shape=shape, ids=ids, crow=crow, col=col), prompt_len=3, vocab=512, cap=8)
    assert message in str(e.value)
    # the same request with a good layout plans: huge sparse width is fine when within the bound
    good = plan(types.TargetPromptIds(shape=(2, 2**30), ids=[5, -1, 9], crow=[0, 2, 3], col=[7, 2**30 - 1, 0]),
                prompt_len=3, vocab=512, cap=8)
    assert good.width == 1 and good.device_ids(2).tolist() == [[5], [9]]
