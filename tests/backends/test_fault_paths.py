"""JaxBackend fault paths: a failed pass commits nothing (issue 12 #5), values that are not finite in
float32 are refused and leave every adapter bit-identical (#10), and training state is updated in place
instead of copied (#19)."""

import jax
import numpy as np
import pytest

import tx
from tests.backends.test_jax_backend import ce_request, new_backend, slot_weights
from tests.helpers import make_batch, random_datums
from tx import types


def state_of(backend, model_id):
    """Everything an adapter holds, as host arrays: weights, gradient sums, Adam state, counters."""
    return {
        "weights": slot_weights(backend, model_id),
        "grads": backend.grad_sum_of(model_id),
        "adam": [np.asarray(x) for x in jax.tree.leaves(backend.opt_state_of(model_id))],
        "counters": dict(backend._accumulated[model_id]),
        "steps": backend.models[model_id].optim_steps,
    }


def assert_bit_identical(before, after):
    for part in ("weights", "grads"):
        for k, v in before[part].items():
            assert v.tobytes() == after[part][k].tobytes(), (part, k)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(before["adam"], after["adam"]))
    assert before["counters"] == after["counters"] and before["steps"] == after["steps"]


# ---- #5: all-or-nothing per call ----


def test_failed_micro_batch_commits_nothing_and_retry_counts_once(tiny_dirs, monkeypatch):
    backend = new_backend(tiny_dirs, train_micro_batch_size=2)
    clean = new_backend(tiny_dirs, train_micro_batch_size=2)
    first = make_batch([ce_request("r0", "a", random_datums(20, [9, 6]))])
    batch = make_batch([ce_request("ra", "a", random_datums(21, [12, 7, 5])), ce_request("rb", "b", random_datums(22, [8, 4]))])
    for b in (backend, clean):
        b.forward_backward(first)  # a holds sums from an earlier call
    real_run = backend.runtime.run
    for fail_on_call in (2, 3, 1):  # 5 rows: micro-batches of 2, 2, 1
        before = {m: state_of(backend, m) for m in ("a", "b")}
        calls = []

        def failing_run(name, fn, *args):
            calls.append(name)
            if name == "forward_backward" and len(calls) == fail_on_call:
                raise RuntimeError("injected failure in micro-batch")
            return real_run(name, fn, *args)

        monkeypatch.setattr(backend.runtime, "run", failing_run)
        with pytest.raises(RuntimeError, match="injected failure"):
            backend.forward_backward(batch)
        for m in ("a", "b"):
            assert_bit_identical(before[m], state_of(backend, m))
        monkeypatch.setattr(backend.runtime, "run", real_run)
        backend.forward_backward(batch)  # the retry counts each datum once
        clean.forward_backward(batch)
        for m in ("a", "b"):
            got, want = state_of(backend, m), state_of(clean, m)
            assert got["counters"] == want["counters"]
            for k, v in want["grads"].items():
                np.testing.assert_allclose(got["grads"][k], v, rtol=1e-6, atol=1e-9)
    assert backend._accumulated["a"] == {"sequences": 2 + 3 * 3, "tokens": 9 + 6 + 3 * (12 + 7 + 5)}


# ---- #10: float32 validation and refused non-finite updates ----


@pytest.mark.parametrize("field,value,message", [
    ("learning_rate", float("inf"), "learning_rate = inf is not finite in float32"),
    ("learning_rate", 1e39, "learning_rate = 1e+39 is not finite in float32"),
    ("weight_decay", 1e39, "weight_decay = 1e+39 is not finite in float32"),
    ("grad_clip_norm", 1e39, "grad_clip_norm = 1e+39 is not finite in float32"),
    ("eps", 1e-46, "eps = 1e-46 is denormal or 0 in float32"),
    ("eps", 1e-40, "eps = 1e-40 is denormal or 0 in float32"),
    ("beta1", 1 - 1e-9, "beta1 = 0.999999999 rounds to 1.0 in float32"),
    ("beta2", 1 - 1e-10, "beta2 = 0.9999999999 rounds to 1.0 in float32"),
])
def test_adam_params_must_be_valid_in_float32(field, value, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+").replace(".", r"\.")):
        types.AdamParams(**{field: value})
    types.AdamParams(eps=2e-38, beta2=0.9999, learning_rate=1e38, weight_decay=1e38)  # representable: accepted


BAD_IN_FLOAT32 = {
    "dro beta 1e300": (("dro", {"beta": 1e300}), {}, "loss_fn_config['beta'] = 1e+300 is not finite in float32"),
    "ppo clip 1e39": (("ppo", {"clip_high_threshold": 1e39}), {},
                      "loss_fn_config['clip_high_threshold'] = 1e+39 is not finite in float32"),
    "advantages 1e39": (("ppo", None), {"advantages": [0.0, 1e39, 0, 0, 0]}, "advantages[1] = 1e+39 is not finite in float32"),
    "weights -4e38": (("cross_entropy", None), {"weights": [1.0, 1, 1, -4e38, 1]}, "weights[3] = -4e+38 is not finite in float32"),
    "logprobs -1e39": (("importance_sampling", None), {"logprobs": [-1e39, 0, 0, 0, 0], "advantages": [1.0] * 5},
                       "logprobs[0] = -1e+39 is not finite in float32"),
    # finite in float32, but the gradients overflow: refused when committing, this model's sums kept
    "advantages 3e38": (("importance_sampling", None), {"logprobs": [-5.0] * 5, "advantages": [3e38] * 5},
                        "gradient sums of model 'a' would not be finite in float32"),
    # the per-token loss itself overflows
    "ratio overflow": (("importance_sampling", None), {"logprobs": [-80.0] * 5, "advantages": [3e38] * 5},
                       "elementwise_loss[0] = -inf is not finite in float32"),
}


def test_values_not_finite_in_float32_fail_alone_and_change_nothing(tiny_dirs):
    backend, alone = new_backend(tiny_dirs), new_backend(tiny_dirs)
    backend.forward_backward(make_batch([ce_request("r0", "a", random_datums(23, [7]))]))
    good = make_batch([ce_request("good", "b", random_datums(24, [6, 9]))])
    want = alone.forward_backward(good)["good"].metrics["loss:sum"]
    for case, ((loss, config), changes, message) in BAD_IN_FLOAT32.items():
        before = state_of(backend, "a")
        bad = random_datums(25, [5])[0] | changes
        request = ("bad", "a", [bad], loss, config)
        out = backend.forward_backward(make_batch([request, ce_request("good", "b", good_datums(good))]))
        assert isinstance(out["bad"], types.ErrorResponse) and message in out["bad"].error, (case, out["bad"])
        assert out["good"].metrics["loss:sum"] == pytest.approx(want, rel=1e-6), case  # the other tenant goes on
        assert_bit_identical(before, state_of(backend, "a"))
        forward = backend.forward(make_batch([request]))["bad"]
        if case == "advantages 3e38":  # forward only: outputs and loss are finite, there are no gradients
            assert isinstance(forward, types.ForwardBackwardOutput) and np.isfinite(forward.metrics["loss:sum"])
        else:
            assert isinstance(forward, types.ErrorResponse) and message in forward.error, case
    assert not any(np.isnan(g).any() for g in backend.grad_sum_of("b").values())


def good_datums(batch):
    return [{"input_ids": i, "targets": t} for i, t in zip(batch.all_input_ids, batch.all_targets)]


def test_other_requests_of_a_refused_model_fail_too(tiny_dirs):
    backend = new_backend(tiny_dirs)
    before = state_of(backend, "a")
    bad = random_datums(26, [5])[0] | {"logprobs": [-80.0] * 5, "advantages": [3e38] * 5}
    out = backend.forward_backward(make_batch([("bad", "a", [bad], "importance_sampling", None),
                                               ce_request("same-model", "a", random_datums(27, [6]))]))
    assert "elementwise_loss" in out["bad"].error
    assert "another request of model 'a' in the same pass failed" in out["same-model"].error
    assert_bit_identical(before, state_of(backend, "a"))


def test_non_finite_optim_step_is_refused_and_can_be_retried(tiny_dirs):
    backend, clean = new_backend(tiny_dirs), new_backend(tiny_dirs)
    batch = make_batch([ce_request("r", "a", random_datums(28, [10, 6]))])
    for b in (backend, clean):
        b.forward_backward(batch)
    before_a, before_b = state_of(backend, "a"), state_of(backend, "b")
    huge = types.AdamParams(learning_rate=3e38, weight_decay=10.0)  # valid float32 values, the update overflows
    with pytest.raises(ValueError, match=r"optim_step of model 'a' refused: the update is not finite in float32 "
                                         r"\(learning_rate=3e\+38"):
        backend.optim_step("a", types.OptimStepInput(adam_params=huge))
    assert_bit_identical(before_a, state_of(backend, "a"))  # gradient sums kept: the step can be retried
    assert_bit_identical(before_b, state_of(backend, "b"))
    ok = types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-2, weight_decay=0.1))
    metrics = backend.optim_step("a", ok).metrics
    want = clean.optim_step("a", ok).metrics
    assert metrics == want and all(np.isfinite(v) for v in metrics.values())
    for k, v in slot_weights(clean, "a").items():
        assert v.tobytes() == slot_weights(backend, "a")[k].tobytes(), k  # Adam's count did not advance


# ---- #19: in-place updates ----


def leaves(tree):
    return jax.tree.leaves(tree)


def test_forward_leaves_the_gradient_sums_in_place(tiny_dirs):
    backend = new_backend(tiny_dirs)
    backend.forward_backward(make_batch([ce_request("r", "a", random_datums(29, [8]))]))
    sums = leaves(backend.state.grad_sum)
    pointers = [x.unsafe_buffer_pointer() for x in sums]
    backend.forward(make_batch([ce_request("r", "a", random_datums(30, [8, 5]))]))
    after = leaves(backend.state.grad_sum)
    assert all(x is y for x, y in zip(sums, after)) and not any(x.is_deleted() for x in sums)
    assert [x.unsafe_buffer_pointer() for x in after] == pointers


def test_slot_writes_donate_instead_of_copying(tiny_dirs, tmp_path):
    backend = new_backend(tiny_dirs)
    backend.forward_backward(make_batch([ce_request("r", "a", random_datums(31, [8]))]))
    sums = leaves(backend.state.grad_sum)
    backend._reset_accumulation("a", grads=True)
    assert all(x.is_deleted() for x in sums)  # zeroing one slot reused the buffers
    assert not any(np.any(g) for g in backend.grad_sum_of("a").values())

    def lora_leaves():
        return [m.lora_a.get_value() for _, m, _ in tx.models.adapters.lora_modules(backend.model)]

    weights = lora_leaves()
    backend.create_model("c", types.LoraConfig(rank=2, seed=3))  # init_adapter writes slot by slot
    assert all(x.is_deleted() for x in weights)
    backend.save_checkpoint(tmp_path / "ckpt", "a")
    weights = lora_leaves()
    backend.load_checkpoint(tmp_path / "ckpt", "a")  # put_slot of the loaded weights
    assert all(x.is_deleted() for x in weights)


def test_slot_writes_keep_the_sharding(tiny_dirs):
    backend = new_backend(tiny_dirs, fully_sharded_data_parallel_size=2, tensor_parallel_size=2)
    before = leaves(nnx_lora(backend)) + leaves(backend.state.grad_sum)
    shardings = [x.sharding for x in before]
    backend.delete_model("b")
    backend.create_model("c", types.LoraConfig(rank=2, seed=3))
    backend.forward_backward(make_batch([ce_request("r", "c", random_datums(32, [8]))]))
    backend.forward(make_batch([ce_request("r", "c", random_datums(33, [8]))]))
    after = leaves(nnx_lora(backend)) + leaves(backend.state.grad_sum)
    assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(after, shardings))
    assert any(not s.is_fully_replicated for s in shardings)  # the check has sharded arrays to compare


def nnx_lora(backend):
    from tx.backends.steps import split_model

    return split_model(backend.model)[1]
