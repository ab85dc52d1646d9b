"""2-D [T, K] targets through the real backend (tiny model): loss, log-probs and gradients equal the sum of
K separate 1-D calls with the same weights; shapes are validated; gspo rows of one adapter leave another
adapter's gradients unchanged."""

import re

import numpy as np
import pytest

import tx
from tests.helpers import make_batch, random_datums
from tx import types

CONFIG = tx.JaxBackendConfig(max_lora_adapters=4, max_lora_rank=4, max_seq_len=32, loss_chunk_size=8)


@pytest.fixture(scope="module")
def backend(tiny_dirs):
    """One backend (one set of compiles): "a" and "b" start identical, "c" differs."""
    backend = tx.JaxBackend(tiny_dirs["dense"], CONFIG)
    for model_id, seed in (("a", 1), ("b", 1), ("c", 2)):
        backend.create_model(model_id, types.LoraConfig(rank=4, alpha=8, seed=seed))
    return backend


def _close(x, y, rtol=1e-5):
    for k in x:
        scale = max(np.abs(x[k]).max(), 1e-12)
        assert np.abs(x[k] - y[k]).max() <= rtol * scale, k


def test_two_d_targets_equal_the_sum_of_k_one_d_calls(backend):
    rng = np.random.default_rng(0)
    k, lengths = 3, [11, 6]
    datums = []
    for n in lengths:  # ids < 512 (the tiny vocabulary); soft top-k style weights, some zero
        datums.append({"input_ids": rng.integers(0, 512, n).tolist(),
                       "targets": rng.integers(0, 512, (n, k)).tolist(),
                       "weights": (rng.uniform(0, 1, (n, k)) * (rng.uniform(size=(n, k)) > 0.2)).tolist()})
    one_d = [[{"input_ids": d["input_ids"], "targets": [row[j] for row in d["targets"]],
               "weights": [row[j] for row in d["weights"]]} for d in datums] for j in range(k)]
    out = backend.forward_backward(make_batch([("r", "a", datums, "cross_entropy", None)]))["r"]
    assert isinstance(out, types.ForwardBackwardOutput), out
    parts = [backend.forward_backward(make_batch([(f"r{j}", "b", one_d[j], "cross_entropy", None)]))[f"r{j}"]
             for j in range(k)]
    np.testing.assert_allclose(out.metrics["loss:sum"], sum(p.metrics["loss:sum"] for p in parts), rtol=1e-5)
    for i, o in enumerate(out.loss_fn_outputs):
        lp = o["logprobs"].to_numpy()
        assert lp.shape == (lengths[i], k)
        for j in range(k):
            np.testing.assert_allclose(lp[:, j], parts[j].loss_fn_outputs[i]["logprobs"].to_numpy(), atol=1e-5)
        want = sum(p.loss_fn_outputs[i]["elementwise_loss"].to_numpy() for p in parts)
        np.testing.assert_allclose(o["elementwise_loss"].to_numpy(), want, rtol=1e-5, atol=1e-6)
    _close(backend.grad_sum_of("a"), backend.grad_sum_of("b"))  # "b" started identical, trained on K 1-D calls
    # a 1-D datum next to 2-D ones in the same call keeps its 1-D log-probs
    mixed = backend.forward(make_batch([("m", "a", [datums[0], one_d[1][1]], "cross_entropy", None)]))["m"]
    assert mixed.loss_fn_outputs[0]["logprobs"].to_numpy().shape == (lengths[0], k)
    np.testing.assert_allclose(mixed.loss_fn_outputs[1]["logprobs"].to_numpy(),
                               parts[1].loss_fn_outputs[1]["logprobs"].to_numpy(), atol=1e-5)


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(weights=[w[:2] for w in d["weights"]]), r"weights has shape \[5, 2\] but target_tokens has \[5, 3\]"),
    (lambda d: d.update(targets=d["targets"][:4]), r"target_tokens has shape \[4, 3\]; it must be \[5\] or \[5, K\]"),
    (lambda d: d["targets"][2].__setitem__(1, 512), r"target_tokens\[2, 1\] = 512 is outside the vocabulary"),
])
def test_two_d_shapes_are_validated(backend, change, message):
    good = {"input_ids": [1, 2, 3, 4, 5], "targets": [[1, 2, 3]] * 5, "weights": [[0.5, 0.3, 0.2]] * 5}
    bad = {"input_ids": list(good["input_ids"]), "targets": [list(r) for r in good["targets"]],
           "weights": [list(r) for r in good["weights"]]}
    change(bad)
    out = backend.forward_backward(make_batch([("bad", "c", [bad], "cross_entropy", None)]))
    assert isinstance(out["bad"], types.ErrorResponse) and re.search(message, out["bad"].error), out["bad"]
    ppo = backend.forward_backward(make_batch([("p", "c", [good], "ppo", None)]))["p"]
    assert "loss 'ppo' takes 1-D targets only" in ppo.error


def test_gspo_rows_of_one_adapter_do_not_change_another_adapters_gradients(tiny_dirs):
    """The same cross_entropy request of adapter "a", once alone and once beside gspo rows of "b" in
    one call: "a"'s gradients are the same."""
    da = random_datums(2, [9, 7])
    db = random_datums(3, [12], logprobs=lambda r, n: r.uniform(-6, -4, n).tolist(),
                       advantages=lambda r, n: r.standard_normal(n).tolist())
    masks = [[0.0] * 9, [0.0] * 7, [0.0] * 3 + [1.0] * 9]
    backend = tx.JaxBackend(tiny_dirs["dense"], CONFIG)
    for model_id in ("a", "a2", "b"):
        backend.create_model(model_id, types.LoraConfig(rank=4, alpha=8, seed=1))
    out = backend.forward_backward(make_batch(
        [("a", "a", da, "cross_entropy", None),
         ("b", "b", db, "gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0})], all_ratio_masks=masks))
    assert all(isinstance(o, types.ForwardBackwardOutput) for o in out.values()), out
    backend.forward_backward(make_batch([("a2", "a2", da, "cross_entropy", None)]))
    _close(backend.grad_sum_of("a"), backend.grad_sum_of("a2"))
    assert any(np.abs(v).max() > 0 for v in backend.grad_sum_of("b").values())
