"""The SDK >= 0.32 sampling fields through the official `tinker` SDK (0.38) against a real `python -m tx.run`
subprocess, checked against transformers on the same tiny checkpoint (torch log_softmax / topk; 1e-5
absolute on float32 log-probs): topk_sample_logprobs, target_prompt_logprobs dense and sparse CSR,
prompt_alt_tokens_k, prompt_logprobs_last_n (sample and compute_logprobs), SampledSequence.sequence_id, the
cookbook's `decisions.sample_decision` unmodified, and hostile values refused with a 400 naming the field."""

import asyncio

import numpy as np
import pytest
import torch
from tinker import types as T
from tinker_cookbook.recipes.decisions import DecisionRendering, sample_decision
from transformers import AutoModelForCausalLM

from tests.api import sdk_flows
from tests.api.server_proc import Server

PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12]
ATOL = 1e-5


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_dirs):
    model = tiny_dirs["dense"]
    srv = Server(tmp_path_factory.mktemp("sample-fields"), base_model=model)
    try:
        client = sdk_flows.service(srv.url).create_sampling_client(base_model=model).result()
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        yield srv, model, client, hf
    finally:
        srv.stop()


def ref_logprobs(hf, tokens) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1).numpy()


def test_sdk_fields_match_transformers(world):
    _, _, client, hf = world
    n = len(PROMPT)
    ref = ref_logprobs(hf, PROMPT)
    ids = torch.full((n - 1, 3), -1, dtype=torch.int64)
    ids[0, 1], ids[5] = 42, torch.tensor([1, 2, 3])
    res = client.sample(T.ModelInput.from_ints(PROMPT), 2, T.SamplingParams(max_tokens=5, temperature=1.0, seed=3),
                        include_prompt_logprobs=True, topk_prompt_logprobs=3, topk_sample_logprobs=3,
                        target_prompt_logprobs=T.TensorData.from_torch(ids), prompt_alt_tokens_k=4,
                        prompt_logprobs_last_n=5).result()
    assert res.prompt_logprobs[: n - 5] == [None] * (n - 5)
    np.testing.assert_allclose(res.prompt_logprobs[n - 5:], [ref[t, PROMPT[t + 1]] for t in range(n - 6, n - 1)],
                               atol=ATOL)
    assert res.topk_prompt_logprobs[: n - 5] == [None] * (n - 5)
    for t, row in zip(range(n - 6, n - 1), res.topk_prompt_logprobs[n - 5:]):
        want = torch.topk(torch.tensor(ref[t]), 3)
        assert [i for i, _ in row] == want.indices.tolist()
        np.testing.assert_allclose([v for _, v in row], want.values.numpy(), atol=ATOL)
    target = res.target_prompt_logprobs.to_numpy()
    want = np.where(ids.numpy() >= 0, ref[np.arange(n - 1)[:, None], np.maximum(ids.numpy(), 0)], 0.0)
    assert target.shape == (n - 1, 3)
    np.testing.assert_allclose(target, want, atol=ATOL)
    alt_ids, alt_lp = res.prompt_alt_tokens.tokens.to_numpy(), res.prompt_alt_tokens.logprobs.to_numpy()
    assert alt_ids.shape == alt_lp.shape == (n - 1, 4) and res.prompt_alt_tokens.tokens.dtype == "int64"
    np.testing.assert_allclose(alt_lp, ref[np.arange(n - 1)[:, None], alt_ids], atol=ATOL)
    ids_seen = set()
    for seq in res.sequences:
        steps = ref_logprobs(hf, PROMPT + seq.tokens)[n - 1 : -1]
        assert len(seq.topk_logprobs) == len(seq.tokens) == len(steps)
        for row, dist in zip(seq.topk_logprobs, steps):
            want = torch.topk(torch.tensor(dist), 3)
            assert [i for i, _ in row] == want.indices.tolist()
            np.testing.assert_allclose([v for _, v in row], want.values.numpy(), atol=ATOL)
        assert isinstance(seq.sequence_id, str) and seq.sequence_id
        ids_seen.add(seq.sequence_id)
    again = client.sample(T.ModelInput.from_ints(PROMPT), 1, T.SamplingParams(max_tokens=1)).result()
    assert again.sequences[0].topk_logprobs is None and again.target_prompt_logprobs is None
    ids_seen.add(again.sequences[0].sequence_id)
    assert len(ids_seen) == 3  # distinct per sequence, across requests too

    # sparse CSR in, the same layout out
    sparse_ids = torch.full((n - 1, 30), -1, dtype=torch.int64)
    sparse_ids[2, 29], sparse_ids[7, 0], sparse_ids[7, 4] = 11, 500, 0
    sparse = T.TensorData.from_torch_sparse(sparse_ids, pad_value=-1)
    assert sparse.sparse_crow_indices is not None
    out = client.sample(T.ModelInput.from_ints(PROMPT), 1, T.SamplingParams(max_tokens=1),
                        target_prompt_logprobs=sparse).result().target_prompt_logprobs
    assert out.sparse_crow_indices == sparse.sparse_crow_indices and out.sparse_col_indices == sparse.sparse_col_indices
    np.testing.assert_allclose(np.asarray(out.data), [ref[2, 11], ref[7, 500], ref[7, 0]], atol=ATOL)

    # compute_logprobs with prompt_logprobs_last_n
    lps = client.compute_logprobs(T.ModelInput.from_ints(PROMPT), prompt_logprobs_last_n=2).result()
    assert lps[: n - 2] == [None] * (n - 2)
    np.testing.assert_allclose(lps[n - 2:], [ref[n - 3, PROMPT[-2]], ref[n - 2, PROMPT[-1]]], atol=ATOL)


def test_cookbook_sample_decision(world):
    """tinker_cookbook.recipes.decisions.sample_decision, unmodified: one sample with a sparse
    target_prompt_logprobs; its probabilities are the softmax of the labels' log-probs at the answer."""
    _, _, client, hf = world
    rendering = DecisionRendering(tokens=PROMPT, choice_pos=len(PROMPT) - 1, label_tokens={"x": 10, "y": 200, "z": 33})
    probs = asyncio.run(sample_decision(client, rendering))
    ref = ref_logprobs(hf, PROMPT)[len(PROMPT) - 2, [10, 200, 33]]
    want = torch.softmax(torch.tensor(ref), 0).numpy()
    assert list(probs) == ["x", "y", "z"]
    np.testing.assert_allclose(list(probs.values()), want, atol=ATOL)


def _body(model: str, **fields) -> dict:
    return {"base_model": model, "num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": 1}, **fields}


def _target(rows, cols, data, dtype="int64", **extra) -> dict:
    return {"data": data, "dtype": dtype, "shape": [rows, cols], **extra}


HOSTILE = [  # (fields, what the 400 must name)
    ({"topk_sample_logprobs": 10**6}, "topk_sample_logprobs = 1000000"),
    ({"topk_sample_logprobs": -1}, "topk_sample_logprobs"),
    ({"prompt_alt_tokens_k": 21}, "prompt_alt_tokens_k = 21"),
    ({"prompt_alt_tokens_k": 2**70}, "prompt_alt_tokens_k"),
    ({"prompt_logprobs_last_n": 3}, "prompt_logprobs_last_n = 3 needs prompt_logprobs"),
    ({"prompt_logprobs": True, "prompt_logprobs_last_n": 9}, "prompt_logprobs_last_n = 9"),
    ({"target_prompt_logprobs": _target(8, 1, [1.5] * 8, dtype="float32")}, "target_prompt_logprobs.dtype"),
    ({"target_prompt_logprobs": {"data": [1] * 8, "dtype": "int64", "shape": [8]}}, "target_prompt_logprobs.shape"),
    ({"target_prompt_logprobs": _target(4, 2, [1] * 8)}, "needs len(prompt) - 1 = 8 rows"),
    ({"target_prompt_logprobs": _target(8, 1, [1] * 7 + [10**6])}, "target_prompt_logprobs[7, 0] = 1000000"),
    ({"target_prompt_logprobs": _target(8, 1, [1] * 7 + [2**80])}, "target_prompt_logprobs"),
    ({"target_prompt_logprobs": _target(8, 1, [-1] * 8)}, "names no token id"),
    ({"target_prompt_logprobs": _target(8, 5, [3], sparse_crow_indices=[0, 1] + [1] * 7,
                                        sparse_col_indices=[7])}, "sparse_col_indices[0] = 7 is outside [0, 5)"),
    ({"target_prompt_logprobs": _target(8, 2**62, [3], sparse_crow_indices=[0, 1] + [1] * 7,
                                        sparse_col_indices=[0])}, "target_prompt_logprobs has shape [8, 4611686018427387904]"),
    ({"target_prompt_logprobs": _target(8, 3, [3], sparse_crow_indices=[0, 1], sparse_col_indices=[0])},
     "sparse_crow_indices"),
    ({"target_prompt_logprobs": _target(8, 100, list(range(100)) * 8)}, "names 100 ids at prompt position 1"),
]


@pytest.mark.parametrize("fields,words", HOSTILE, ids=[w for _, w in HOSTILE])
def test_hostile_fields_are_400_naming_the_field(world, fields, words):
    srv, model, _, _ = world
    r = srv.post("/api/v1/asample", json=_body(model, **fields))
    assert r.status_code == 400 and words in r.text, (r.status_code, r.text)
