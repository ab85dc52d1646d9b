"""The official SDK against a real server: 2-D [T, K] targets (sent by the SDK as sparse CSR from a torch
tensor) equal K 1-D calls; gspo and stable_reinforce losses equal numpy on the formulas from the returned
log-probs; stable_reinforce resolves `sequence_id`s of sequences sampled with record_stability_info and
answers another tenant's ids like unknown ones."""

import numpy as np
import pytest
import tinker
import torch
from tinker import types as T

from tests.api.server_proc import API_KEY, CLIENTS, Server

BOB = "tml-tx-losses-bob"
REFUSED = (tinker.BadRequestError, tinker.RequestFailedError)  # a 400 at submit time, or a failed future


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("losses"), "--api-key", BOB)
    yield srv
    srv.stop()


def client(url, key=API_KEY, seed=5):
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    CLIENTS.setdefault(url, []).append(sc)
    return sc.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()


def test_two_d_targets_equal_k_one_d_calls(server):
    rng = np.random.default_rng(0)
    n, k = 10, 8
    ids = rng.integers(0, 500, n).tolist()
    targets = rng.integers(0, 500, (n, k))
    weights = rng.uniform(0, 1, (n, k)).astype(np.float32)
    weights[rng.uniform(size=(n, k)) < 0.85] = 0  # sent as sparse CSR (unlisted cells are 0)
    two_d = T.Datum(model_input=T.ModelInput.from_ints(ids),
                    loss_fn_inputs={"target_tokens": torch.tensor(targets),
                                    "weights": T.TensorData.from_torch_sparse(torch.tensor(weights))})
    assert two_d.loss_fn_inputs["weights"].sparse_crow_indices is not None
    one_d = [T.Datum(model_input=T.ModelInput.from_ints(ids),
                     loss_fn_inputs={"target_tokens": targets[:, j].tolist(), "weights": weights[:, j].tolist()})
             for j in range(k)]
    a, b = client(server.url), client(server.url)  # the same seed: identical adapters
    out = a.forward_backward([two_d], "cross_entropy").result()
    parts = [b.forward_backward([d], "cross_entropy").result() for d in one_d]
    np.testing.assert_allclose(out.metrics["loss:sum"], sum(p.metrics["loss:sum"] for p in parts), rtol=1e-5)
    lp = out.loss_fn_outputs[0]["logprobs"]
    assert list(lp.shape) == [n, k]
    lp = np.asarray(lp.data, np.float64).reshape(n, k)
    for j, p in enumerate(parts):
        np.testing.assert_allclose(lp[:, j], np.asarray(p.loss_fn_outputs[0]["logprobs"].data), atol=1e-5)
    # equal gradients: after one step (eps=1 makes Adam's first update ~ lr * g) both adapters agree
    adam = T.AdamParams(learning_rate=1e-2, eps=1.0)
    a.optim_step(adam).result()
    b.optim_step(adam).result()
    after_a = a.forward([one_d[0]], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    after_b = b.forward([one_d[0]], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    before = parts[0].loss_fn_outputs[0]["logprobs"].data
    assert np.abs(np.subtract(after_a, before)).max() > 1e-5  # the step did something
    np.testing.assert_allclose(after_a, after_b, atol=1e-5)
    with pytest.raises(REFUSED, match=r"weights'\] has shape \[10, 3\] but 'target_tokens' has \[10, 8\]"):
        bad = T.Datum(model_input=T.ModelInput.from_ints(ids),
                      loss_fn_inputs={"target_tokens": torch.tensor(targets), "weights": torch.ones(n, 3)})
        a.forward([bad], "cross_entropy").result()


def rl_datums(tc, prompt, num_samples=3, provenance=True):
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True)
    res = sampler.sample(T.ModelInput.from_ints(prompt), num_samples,
                         T.SamplingParams(max_tokens=6, temperature=1.0, seed=3)).result()
    out = []
    for i, seq in enumerate(res.sequences):
        ob = len(prompt) - 1
        model_input = T.ModelInput.from_ints(prompt + seq.tokens[:-1])
        adv = [0.0] * ob + [float(i) - 1.0] * len(seq.tokens)
        datum = T.Datum(model_input=model_input, loss_fn_inputs={
            "target_tokens": [0] * ob + seq.tokens, "logprobs": [0.0] * ob + seq.logprobs, "advantages": adv})
        if provenance:
            datum = datum.with_provenance(
                model_input=[T.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
                             T.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1)],
                loss_fn_inputs=[T.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=ob),
                                T.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens))])
        out.append((datum, seq, ob))
    return out


def test_stable_reinforce_and_gspo_match_numpy(server):
    tc = client(server.url, seed=9)
    rows = rl_datums(tc, [5, 6, 7, 8])
    config = {"kl_coeff": 0.2, "clip_high_threshold": 1.5}
    out = tc.forward_backward([d for d, _, _ in rows], "stable_reinforce", loss_fn_config=config).result()
    total = 0.0
    for (datum, seq, ob), o in zip(rows, out.loss_fn_outputs):
        tlp = np.asarray(o["logprobs"].data, np.float64)[ob:]
        q = np.asarray(seq.logprobs, np.float64)  # what the server recorded at sampling time
        a = np.asarray(datum.loss_fn_inputs["advantages"].data, np.float64)[ob:]
        total += np.sum(-np.minimum(np.exp(tlp - q), 1.5) * a * tlp + 0.1 * (tlp - q) ** 2)
    np.testing.assert_allclose(out.metrics["loss:sum"], total, rtol=1e-5, atol=1e-5)

    gspo_rows = rl_datums(tc, [9, 10, 11], provenance=False)
    cfg = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    data = []
    for datum, seq, ob in gspo_rows:
        mask = [0.0] * ob + [1.0] * len(seq.tokens)
        data.append(T.Datum(model_input=datum.model_input,
                            loss_fn_inputs={**datum.loss_fn_inputs, "sequence_ratio_mask": mask}))
    out = tc.forward_backward(data, "gspo", loss_fn_config=cfg).result()
    total = 0.0
    for (datum, seq, ob), o in zip(gspo_rows, out.loss_fn_outputs):
        tlp = np.asarray(o["logprobs"].data, np.float64)[ob:]
        a = np.asarray(datum.loss_fn_inputs["advantages"].data, np.float64)[ob:]
        s = np.exp(np.mean(tlp - np.asarray(seq.logprobs, np.float64)))
        total += np.sum(-np.minimum(s * a, np.clip(s, 0.9, 1.1) * a))
    np.testing.assert_allclose(out.metrics["loss:sum"], total, rtol=1e-5, atol=1e-5)


def test_stable_reinforce_refuses_foreign_unknown_and_mismatched_sequences(server):
    alice, bob = client(server.url, seed=3), client(server.url, BOB, seed=3)
    (datum, seq, ob), *_ = rl_datums(alice, [1, 2, 3], num_samples=1)
    # bob names alice's sequence: the same answer as an id that never existed
    errors = []
    for sequence_id in (seq.sequence_id, "no-such-request:0"):
        spans = [T.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=ob),
                 T.SampledProvenanceSpan(sequence_id=sequence_id, length=len(seq.tokens))]
        foreign = T.Datum(model_input=datum.model_input, loss_fn_inputs=datum.loss_fn_inputs).with_provenance(
            model_input=[T.PromptProvenanceSpan(sequence_id=sequence_id, length=datum.model_input.length)],
            loss_fn_inputs=spans)
        with pytest.raises(REFUSED) as e:
            bob.forward_backward([foreign], "stable_reinforce").result()
        errors.append(str(e.value).replace(repr(sequence_id), "<id>"))
    assert errors[0] == errors[1] and "names no sequence sampled in this session" in errors[0]
    with pytest.raises(REFUSED, match="needs provenance"):
        alice.forward_backward([T.Datum(model_input=datum.model_input, loss_fn_inputs=datum.loss_fn_inputs)],
                               "stable_reinforce").result()
    tampered = dict(datum.loss_fn_inputs)
    tokens = list(tampered["target_tokens"].data)
    tokens[-1] = (tokens[-1] + 1) % 500
    tampered["target_tokens"] = tokens
    bad = T.Datum(model_input=datum.model_input, loss_fn_inputs=tampered).with_provenance(
        model_input=datum.model_input_spans, loss_fn_inputs=datum.loss_fn_input_spans)
    with pytest.raises(REFUSED, match=rf"target_tokens'\]\[{len(tokens) - 1}\] = .* sampled"):
        alice.forward_backward([bad], "stable_reinforce").result()
