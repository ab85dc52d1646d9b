"""Packed rows (several examples per datum, segment ids) compute exactly what the examples compute alone."""

import numpy as np

from tests.backends.test_jax_backend import _assert_close_trees, ce_request, new_backend
from tests.helpers import make_batch, random_datums
from tx import types


def test_packed_equals_unpacked(tiny_dirs):
    examples = random_datums(21, [9, 5, 12, 3])
    unpacked = new_backend(tiny_dirs)
    out = unpacked.forward_backward(make_batch([ce_request("r", "a", examples)]))["r"]
    packed_datums, segments = [], []
    for pair in (examples[:2], examples[2:]):
        packed_datums.append({k: sum((d[k] for d in pair), []) for k in ("input_ids", "targets")})
        segments.append(sum(([s] * len(d["input_ids"]) for s, d in enumerate(pair)), []))
    packed = new_backend(tiny_dirs)
    batch = make_batch([ce_request("r", "a", packed_datums)], all_segment_ids=segments)
    packed_out = packed.forward_backward(batch)["r"]
    got = np.concatenate([o["logprobs"].to_numpy() for o in packed_out.loss_fn_outputs])
    want = np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert abs(packed_out.metrics["loss:sum"] - out.metrics["loss:sum"]) <= 1e-5 * abs(out.metrics["loss:sum"])
    _assert_close_trees(unpacked.grad_sum_of("a"), packed.grad_sum_of("a"))
    # without segment ids the same rows attend across examples: different numbers
    crossed = new_backend(tiny_dirs).forward(make_batch([ce_request("r", "a", packed_datums)]))["r"]
    assert not np.allclose(np.concatenate([o["logprobs"].to_numpy() for o in crossed.loss_fn_outputs]), want, atol=1e-3)


def test_bad_segment_ids_fail_alone(tiny_dirs):
    backend = new_backend(tiny_dirs)
    datums = random_datums(22, [4, 4])
    batch = make_batch([ce_request("bad", "a", datums[:1]), ce_request("good", "a", datums[1:])],
                       all_segment_ids=[[0, 1, 0, 1], [0, 0, 1, 1]])
    out = backend.forward(batch)
    assert isinstance(out["bad"], types.ErrorResponse) and "segment_ids must be 4 non-decreasing" in out["bad"].error
    assert isinstance(out["good"], types.ForwardBackwardOutput)
