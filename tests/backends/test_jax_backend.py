"""JaxBackend: parity, isolation between adapters, batching equivalence, AdamW, SFT, custom losses,
bad inputs, slots and compile counts."""

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import tx
from tests.helpers import hf_logprobs, make_batch, peft_model_of, random_datums
from tx import types
from tx.models import decoder
from tx.models.adapters import get_adapter_weights, lora_modules
from tx.models.logprobs import frozen_head_target_logprobs

CONFIG = tx.JaxBackendConfig(max_lora_adapters=4, max_lora_rank=8, max_seq_len=64)


def new_backend(tiny_dirs, **overrides):
    backend = tx.JaxBackend(tiny_dirs["dense"], CONFIG.model_copy(update=overrides))
    backend.create_model("a", types.LoraConfig(rank=8, alpha=16, seed=1))
    backend.create_model("b", types.LoraConfig(rank=4, alpha=8, seed=2, train_mlp=False))
    return backend


def ce_request(request_id, model_id, datums):
    return (request_id, model_id, datums, "cross_entropy", None)


def step(backend, model_id, datums, **adam):
    out = backend.forward_backward(make_batch([ce_request("r", model_id, datums)]))["r"]
    assert isinstance(out, types.ForwardBackwardOutput), out
    backend.optim_step(model_id, types.OptimStepInput(adam_params=types.AdamParams(**adam)))
    return out.metrics["loss:sum"]


def slot_weights(backend, model_id):
    """{"dotted.path.lora_a" / "lora_b" / "lora_scale": that slot's values}."""
    slot = backend.models[model_id].adapter_index
    out = {}
    for path, module, _ in lora_modules(backend.model):
        for name in ("lora_a", "lora_b", "lora_scale"):
            value = np.asarray(getattr(module, name).get_value())
            out[".".join(path + (name,))] = np.take(value, slot, axis=-1 if name == "lora_scale" else -3)
    return out


def test_forward_matches_transformers_and_peft_after_training(tiny_dirs):
    backend = new_backend(tiny_dirs)
    train = random_datums(0, [12, 12])
    for _ in range(3):
        step(backend, "a", train, learning_rate=1e-2)
        step(backend, "b", train, learning_rate=1e-2)
    datums = random_datums(1, [10, 7, 12])
    batch = make_batch([ce_request("ra", "a", datums[:2]), ce_request("rb", "b", datums[2:])])
    out = backend.forward(batch)
    for request_id, model_id, rows in [("ra", "a", datums[:2]), ("rb", "b", datums[2:])]:
        meta = backend.models[model_id]
        weights = get_adapter_weights(backend.model, meta.adapter_index, meta.lora_config.rank)
        assert all(("mlp" in k) == (model_id == "a") for k in weights if "mlp" in k)  # b does not train the MLP
        peft = peft_model_of(tiny_dirs["dense"], weights, meta.lora_config.rank, meta.lora_config.alpha)
        for datum, output in zip(rows, out[request_id].loss_fn_outputs):
            ids = np.array([datum["input_ids"]])
            want = hf_logprobs(peft, ids, np.ones_like(ids), np.array([datum["targets"]]))[0]
            got = output["logprobs"].to_numpy()
            assert np.abs(got - want).max() <= 1e-4
            np.testing.assert_allclose(output["elementwise_loss"].to_numpy(), -got, rtol=1e-6)
        total = sum(-o["logprobs"].to_numpy().sum() for o in out[request_id].loss_fn_outputs)
        np.testing.assert_allclose(out[request_id].metrics["loss:sum"], total, rtol=1e-5)


def test_training_one_adapter_leaves_the_other_bit_identical(tiny_dirs):
    backend = new_backend(tiny_dirs)
    backend.forward_backward(make_batch([ce_request("r", "b", random_datums(2, [9, 5]))]))  # b has grad sums
    weights_b, grads_b = slot_weights(backend, "b"), backend.grad_sum_of("b")
    opt_b = jax.tree.map(np.asarray, backend.opt_state_of("b"))
    assert any(np.any(g) for g in grads_b.values())
    before_a = slot_weights(backend, "a")
    for i in range(3):
        step(backend, "a", random_datums(3 + i, [12, 8]), learning_rate=1e-2, weight_decay=0.1)
    assert any(not np.array_equal(before_a[k], v) for k, v in slot_weights(backend, "a").items())
    for k, v in slot_weights(backend, "b").items():
        assert np.array_equal(weights_b[k], v), k
    for k, v in backend.grad_sum_of("b").items():
        assert np.array_equal(grads_b[k], v), k
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, np.asarray(y)), opt_b, backend.opt_state_of("b"))


def test_passes_skip_the_head_delta_only_where_no_row_adapts_the_head(tiny_dirs, monkeypatch):
    """An adapter that does not train the LM head has head scale 0: its passes skip the head's LoRA delta
    (exactly zero for it) and give the same log-probs, losses and gradient sums as the pass that computes it (to
    1e-6 of each gradient's scale: two programs, whose sums XLA may order differently); a batch with a row of a
    head-training adapter computes it, and that adapter's head factors train. The pass without the delta runs
    the frozen-head log-probs (no rematerialised logits), so this also compares that backward with autodiff's."""
    backend = new_backend(tiny_dirs)
    backend.create_model("n", types.LoraConfig(rank=8, alpha=16, seed=3, train_unembed=False))
    datums = random_datums(4, [11, 6, 9])
    frozen_calls = []

    def frozen_spy(*args):
        frozen_calls.append(args[0].shape)
        return frozen_head_target_logprobs(*args)

    monkeypatch.setattr(decoder, "frozen_head_target_logprobs", frozen_spy)
    plain = backend.forward_backward(make_batch([ce_request("r", "n", datums)]))["r"]
    skipped = {k[-1] for k in backend.runtime.keys() if k[0] == "grads"}
    assert skipped == {False}  # the program without the head delta
    assert frozen_calls  # traced through the frozen head
    grads_plain = backend.grad_sum_of("n")
    backend.delete_model("n")
    backend.create_model("n", types.LoraConfig(rank=8, alpha=16, seed=3, train_unembed=False))
    monkeypatch.setattr(backend, "_head_adapted", lambda slots: True)  # force the delta in
    traced = len(frozen_calls)
    forced = backend.forward_backward(make_batch([ce_request("r", "n", datums)]))["r"]
    assert len(frozen_calls) == traced  # the head with its delta: the rematerialising pass
    monkeypatch.undo()
    for x, y in zip(plain.loss_fn_outputs, forced.loss_fn_outputs):
        for key in ("logprobs", "elementwise_loss"):
            np.testing.assert_allclose(x[key].to_numpy(), y[key].to_numpy(), rtol=0, atol=1e-6, err_msg=key)
    _assert_close_trees(grads_plain, backend.grad_sum_of("n"), rtol=1e-6)
    # a row of "a" (trains the head) in the batch: the delta is computed and a's head factors get gradients
    mixed = make_batch([ce_request("ra", "a", datums[:1]), ce_request("rn", "n", datums[1:])])
    assert backend._head_adapted({backend.models["a"].adapter_index, backend.models["n"].adapter_index})
    backend.forward_backward(mixed)
    head = {k: v for k, v in backend.grad_sum_of("a").items() if k.startswith("lm_head")}
    assert head and any(np.any(v) for v in head.values())


def _grads(backend, model_id):
    return backend.grad_sum_of(model_id)


def _assert_close_trees(x, y, rtol=1e-5):
    for k in x:
        scale = max(np.abs(x[k]).max(), 1e-12)
        assert np.abs(x[k] - y[k]).max() <= rtol * scale, k


def test_mixed_batch_equals_separate_calls_and_micro_batches(tiny_dirs):
    da, db = random_datums(4, [14, 6, 9]), random_datums(5, [3, 11])
    mixed = new_backend(tiny_dirs)
    out = mixed.forward_backward(make_batch([ce_request("ra", "a", da), ce_request("rb", "b", db)]))
    separate = new_backend(tiny_dirs)
    out_a = separate.forward_backward(make_batch([ce_request("ra", "a", da)]))
    out_b = separate.forward_backward(make_batch([ce_request("rb", "b", db)]))
    micro = new_backend(tiny_dirs, train_micro_batch_size=2)
    out_micro = micro.forward_backward(make_batch([ce_request("ra", "a", da), ce_request("rb", "b", db)]))
    assert micro.metrics.calls["forward_backward"] == 3  # 5 rows in micro-batches of 2
    for model_id in ("a", "b"):
        _assert_close_trees(_grads(mixed, model_id), _grads(separate, model_id))
        _assert_close_trees(_grads(mixed, model_id), _grads(micro, model_id))
    for request_id, alone in (("ra", out_a), ("rb", out_b)):
        for x, y, z in zip(out[request_id].loss_fn_outputs, alone[request_id].loss_fn_outputs,
                           out_micro[request_id].loss_fn_outputs):
            # the same datum padded to different lengths (16 alone, 16/24 mixed) gives the same values
            np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), atol=1e-5)
            np.testing.assert_allclose(x["logprobs"].to_numpy(), z["logprobs"].to_numpy(), atol=1e-5)


def numpy_adamw(params, grads, state, hp, t):
    """One AdamW step in float64, written from the algorithm (Loshchilov & Hutter, with Adam's bias
    correction), not from optax: the global gradient norm is clipped to grad_clip_norm (0 = off), then
    m, v are updated, and p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)."""
    norm = np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in grads.values()))
    clip = hp["grad_clip_norm"]
    scale = clip / norm if clip > 0 and norm > clip else 1.0
    new = {}
    for k, p in params.items():
        g = grads[k].astype(np.float64) * scale
        m, v = state.get(k, (0.0, 0.0))
        m = hp["beta1"] * m + (1 - hp["beta1"]) * g
        v = hp["beta2"] * v + (1 - hp["beta2"]) * g * g
        m_hat, v_hat = m / (1 - hp["beta1"] ** t), v / (1 - hp["beta2"] ** t)
        new[k] = p - hp["learning_rate"] * (m_hat / (np.sqrt(v_hat) + hp["eps"]) + hp["weight_decay"] * p)
        state[k] = (m, v)
    return new, norm, scale


def test_adamw_matches_an_independent_numpy_adamw_over_steps(tiny_dirs):
    """Four steps with changing hyperparameters (clipping on and off, weight decay): weights agree with a
    float64 numpy AdamW to |diff| <= 1e-6 + 1e-5 |ref| (float32 on the device), grad_norm to rtol 1e-5."""
    backend = new_backend(tiny_dirs)
    schedule = [
        dict(learning_rate=3e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.05, grad_clip_norm=0.5),
        dict(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.0, grad_clip_norm=0.0),
        dict(learning_rate=5e-3, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.2, grad_clip_norm=100.0),
        dict(learning_rate=2e-3, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.1),
    ]
    weights = slot_weights(backend, "a")
    keys = sorted(k for k in weights if not k.endswith("lora_scale"))
    ref = {k: weights[k].astype(np.float64) for k in keys}
    state: dict = {}
    clipped = []
    for t, hp in enumerate(schedule, start=1):
        backend.forward_backward(make_batch([ce_request("r", "a", random_datums(40 + t, [12, 10]))]))
        grads = {k: v for k, v in backend.grad_sum_of("a").items() if k in ref}
        ref, norm, scale = numpy_adamw(ref, grads, state, hp, t)
        metrics = backend.optim_step("a", types.OptimStepInput(adam_params=types.AdamParams(**hp))).metrics
        np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=1e-5)
        np.testing.assert_allclose(metrics["grad_clip_scale"], scale, rtol=1e-5)
        clipped.append(scale < 1)
        after = slot_weights(backend, "a")
        for k in keys:
            np.testing.assert_allclose(after[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=f"step {t}: {k}")
        assert metrics["accumulated_sequences"] == 2
        assert not any(np.any(g) for g in backend.grad_sum_of("a").values())  # reset after the step
    assert clipped == [True, False, False, True]  # both branches of clipping were exercised


def test_sft_drives_cross_entropy_down(tiny_dirs):
    backend = tx.JaxBackend(tiny_dirs["dense"], CONFIG.model_copy(update={"max_lora_adapters": 2}))
    backend.create_model("sft", types.LoraConfig(rank=8, alpha=16, seed=0))
    data = random_datums(7, [16, 16, 16, 16])
    losses = [step(backend, "sft", data, learning_rate=2e-2) for _ in range(40)]
    assert losses[-1] <= 0.1 * losses[0], (losses[0], losses[-1])
    assert backend.metrics.compiles == {"forward_backward": 1, "optim_step": 1}


@tx.losses.register("test_scaled_square", config_defaults={"scale": 1.0})
def scaled_square(tlp, inputs, config):
    """A custom loss: scale * advantages * (tlp + 1)^2."""
    return config["scale"] * inputs["advantages"] * (tlp + 1.0) ** 2


def test_custom_loss_trains_and_matches_numpy(tiny_dirs):
    backend = new_backend(tiny_dirs)
    datums = random_datums(8, [10, 6], advantages=lambda rng, n: rng.uniform(0.5, 1.5, n).tolist())
    request = ("r", "a", datums, "test_scaled_square", {"scale": 0.5})
    first = None
    for _ in range(5):
        out = backend.forward_backward(make_batch([request]))["r"]
        for datum, output in zip(datums, out.loss_fn_outputs):
            tlp = output["logprobs"].to_numpy()
            want = 0.5 * np.asarray(datum["advantages"]) * (tlp + 1.0) ** 2
            np.testing.assert_allclose(output["elementwise_loss"].to_numpy(), want, rtol=1e-5)
        first = first or out.metrics["loss:sum"]
        backend.optim_step("a", types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-2)))
    assert out.metrics["loss:sum"] < 0.7 * first


TRACED: list[str] = []  # which spy losses a pass traced


@tx.losses.register("test_spy_a")
def spy_a(tlp, inputs, config):
    TRACED.append("a")
    return -tlp * inputs["weights"]


@tx.losses.register("test_spy_b")
def spy_b(tlp, inputs, config):
    TRACED.append("b")
    return -2.0 * tlp * inputs["weights"]


def test_a_pass_evaluates_only_the_losses_its_rows_use(tiny_dirs):
    """Every loss registered in this process is not evaluated on every row: a pass is compiled per set of losses
    present in the call, so a cross-entropy round never traces (or pays for) the others."""
    backend = new_backend(tiny_dirs)
    datums = random_datums(5, [7, 5])
    TRACED.clear()
    ce = backend.forward_backward(make_batch([ce_request("ce", "a", datums)]))["ce"]
    assert TRACED == []
    mixed = backend.forward_backward(make_batch([ce_request("ce", "a", datums), ("b", "a", datums, "test_spy_b", None)]))
    assert sorted(set(TRACED)) == ["b"]
    for want, got, b in zip(ce.loss_fn_outputs, mixed["ce"].loss_fn_outputs, mixed["b"].loss_fn_outputs):
        np.testing.assert_allclose(got["elementwise_loss"].to_numpy(), want["elementwise_loss"].to_numpy(), rtol=1e-6)
        np.testing.assert_allclose(b["elementwise_loss"].to_numpy(), 2 * want["elementwise_loss"].to_numpy(), rtol=1e-6)
    assert "a" not in TRACED


@tx.losses.register("test_pull_to_ref", config_defaults={"scale": 1.0}, input_keys=("ref_logprobs",))
def pull_to_ref(tlp, inputs, config):
    """A custom loss with an extra per-token input: scale * weights * (tlp - ref_logprobs)^2."""
    return config["scale"] * inputs["weights"] * (tlp - inputs["ref_logprobs"]) ** 2


def test_extra_loss_inputs_reach_the_loss_and_are_checked(tiny_dirs):
    backend = new_backend(tiny_dirs)
    datums = random_datums(12, [9, 4])
    rng = np.random.default_rng(3)
    ref = [rng.uniform(-8, -4, len(d["input_ids"])).tolist() for d in datums]
    out = backend.forward_backward(make_batch([("r", "a", datums, "test_pull_to_ref", {"scale": 0.5})],
                                              all_extra_inputs={"ref_logprobs": ref}))["r"]
    for output, r in zip(out.loss_fn_outputs, ref):
        tlp = output["logprobs"].to_numpy().astype(np.float64)
        np.testing.assert_allclose(output["elementwise_loss"].to_numpy(), 0.5 * (tlp - np.asarray(r)) ** 2, rtol=1e-5)
    left_out = backend.forward(make_batch([("r", "a", datums, "test_pull_to_ref", None)]))["r"]
    tlp = left_out.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64)
    np.testing.assert_allclose(left_out.loss_fn_outputs[0]["elementwise_loss"].to_numpy(), tlp ** 2, rtol=1e-5)

    weights_b = slot_weights(backend, "b")
    bad = backend.forward_backward(make_batch(
        [("ce", "b", datums, "cross_entropy", None), ("nan", "b", datums, "test_pull_to_ref", None)],
        all_extra_inputs={"ref_logprobs": [ref[0], [], [], [0.0, float("nan"), 0.0, 0.0]]}))
    assert "loss_fn_inputs key 'ref_logprobs' is not read by loss 'cross_entropy'" in bad["ce"].error
    assert "ref_logprobs[1] = nan is not finite" in bad["nan"].error
    assert not any(np.any(g) for g in backend.grad_sum_of("b").values())
    for k, v in slot_weights(backend, "b").items():
        assert np.array_equal(weights_b[k], v)
    with pytest.raises(ValueError, match="must be an identifier other than"):
        tx.losses.register("test_bad_key", lambda t, i, c: t, input_keys=("advantages",))


@tx.losses.register("test_max_entropy", needs_entropy=True)
def max_entropy(tlp, inputs, config):
    """A loss that reads each position's entropy: -weights * entropy."""
    return -inputs["weights"] * inputs["entropy"]


def test_entropy_input_matches_torch_and_trains(tiny_dirs):
    backend = new_backend(tiny_dirs)
    datums = random_datums(15, [8, 5])
    mixed = make_batch([("ent", "a", datums, "test_max_entropy", None), ("ce", "b", datums, "cross_entropy", None)])
    out = backend.forward(mixed)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["dense"], dtype=torch.float32)  # adapters start as the base
    for datum, output in zip(datums, out["ent"].loss_fn_outputs):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([datum["input_ids"]])).logits[0].double()
        want = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1).numpy()
        np.testing.assert_allclose(output["entropy"].to_numpy(), want, atol=1e-4)
        np.testing.assert_allclose(output["elementwise_loss"].to_numpy(), -want, atol=1e-4)
    assert all("entropy" not in o for o in out["ce"].loss_fn_outputs)  # only rows whose loss reads it
    before = out["ent"].metrics["loss:sum"]
    losses_seen = [before]
    for _ in range(3):
        backend.forward_backward(make_batch([("ent", "a", datums, "test_max_entropy", None)]))
        backend.optim_step("a", types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-3)))
        losses_seen.append(backend.forward(make_batch([("ent", "a", datums, "test_max_entropy", None)]))["ent"]
                           .metrics["loss:sum"])
    assert all(b < a for a, b in zip(losses_seen, losses_seen[1:])), losses_seen  # maximising it raises it


def test_temperature_scales_the_logits_per_datum_as_torch(tiny_dirs):
    """all_temperatures: log-probs and entropy of softmax(logits / T) per datum; T = 1 rows in the same call are
    the untempered ones; a T that is not > 0 in float32 fails its request alone."""
    backend = new_backend(tiny_dirs)
    datums = random_datums(17, [8, 5])
    batch = make_batch([("hot", "a", datums, "test_max_entropy", None), ("plain", "a", datums, "test_max_entropy", None),
                        ("bad", "a", datums[:1], "cross_entropy", None)],
                       all_temperatures=[0.7, 0.7, 1.0, 1.0, 1e-46])
    out = backend.forward(batch)
    assert "datum 0: temperature = 1e-46 must be > 0" in out["bad"].error
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["dense"], dtype=torch.float32)
    for name, t in (("hot", 0.7), ("plain", 1.0)):
        for datum, output in zip(datums, out[name].loss_fn_outputs):
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([datum["input_ids"]])).logits[0].double() / t
            lp = torch.log_softmax(logits, -1)
            want = lp.gather(-1, torch.tensor(datum["targets"])[:, None])[:, 0].numpy()
            np.testing.assert_allclose(output["logprobs"].to_numpy(), want, atol=1e-4)
            np.testing.assert_allclose(output["entropy"].to_numpy(), -(lp.exp() * lp).sum(-1).numpy(), atol=1e-4)


@tx.losses.register("test_value_mse", needs_values=True, needs_logprobs=False)
def value_mse(tlp, inputs, config):
    """A critic's loss: weights * (V - advantages)^2 (advantages standing in for the returns); it never reads
    log-probs, so a pass of only its rows skips the LM head."""
    return inputs["weights"] * (inputs["values"] - inputs["advantages"]) ** 2


def test_value_head_matches_torch_hidden_states_and_trains_only_its_slot(tiny_dirs):
    backend = new_backend(tiny_dirs)
    head = backend.model.lm_head.value_head
    assert not np.any(np.asarray(head[...]))  # V = 0 at init
    w_d = np.random.default_rng(4).normal(size=head[...].shape[1]).astype(np.float32)
    head.set_value(head[...].at[1, :, 0].set(w_d))  # slot 1 = model "a"
    datums = random_datums(16, [8, 5], advantages=lambda rng, n: rng.uniform(0.5, 1.5, n).tolist())
    out = backend.forward(make_batch([("v", "a", datums, "test_value_mse", None), ("ce", "b", datums, "cross_entropy", None)]))
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["dense"], dtype=torch.float32)  # B = 0: the base's states
    for datum, output in zip(datums, out["v"].loss_fn_outputs):
        with torch.no_grad():
            h = hf(input_ids=torch.tensor([datum["input_ids"]]), output_hidden_states=True).hidden_states[-1][0]
        want = h.double().numpy() @ w_d.astype(np.float64)  # the last hidden state is after the final norm
        np.testing.assert_allclose(output["values"].to_numpy(), want, atol=1e-4)
    assert all("values" not in o for o in out["ce"].loss_fn_outputs)
    assert all("logprobs" not in o for o in out["v"].loss_fn_outputs)  # it reads none: none returned
    alone = backend.forward(make_batch([("v", "a", datums, "test_value_mse", None)]))["v"]  # no LM head in this pass
    for mixed, single in zip(out["v"].loss_fn_outputs, alone.loss_fn_outputs):
        np.testing.assert_allclose(single["values"].to_numpy(), mixed["values"].to_numpy(), rtol=1e-5, atol=2e-5)
    other = np.asarray(head[...][2]).copy()
    seen = [out["v"].metrics["loss:sum"]]
    for _ in range(3):
        backend.forward_backward(make_batch([("v", "a", datums, "test_value_mse", None),
                                             ("ce", "b", datums, "cross_entropy", None)]))
        backend.optim_step("a", types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-3)))
        backend.optim_step("b", types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-3)))
        seen.append(backend.forward(make_batch([("v", "a", datums, "test_value_mse", None)]))["v"].metrics["loss:sum"])
    assert all(b < a for a, b in zip(seen, seen[1:])), seen  # V moves toward its targets
    np.testing.assert_array_equal(np.asarray(head[...][2]), other)  # b's head: no loss of b read it
    assert np.any(np.asarray(head[...][1]) != w_d[:, None])


def test_forward_of_the_base_model_matches_transformers(tiny_dirs):
    """model id "" in forward reads slot 0, the base model (an RL reference policy); it cannot be trained."""
    backend = new_backend(tiny_dirs)
    step(backend, "a", random_datums(13, [6]), learning_rate=5e-2)  # "a" differs from the base now
    datums = random_datums(14, [7, 3])
    out = backend.forward(make_batch([("base", "", datums, "cross_entropy", None),
                                      ("a", "a", datums, "cross_entropy", None)]))
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["dense"], dtype=torch.float32)
    for datum, base, tuned in zip(datums, out["base"].loss_fn_outputs, out["a"].loss_fn_outputs):
        ids = np.array([datum["input_ids"]])
        want = hf_logprobs(hf, ids, np.ones_like(ids), np.array([datum["targets"]]))[0]
        np.testing.assert_allclose(base["logprobs"].to_numpy(), want, atol=1e-4)
        assert np.abs(tuned["logprobs"].to_numpy() - want).max() > 1e-3
    refused = backend.forward_backward(make_batch([("base", "", datums, "cross_entropy", None)]))["base"]
    assert "unknown model_id ''" in refused.error


BAD = {
    "unknown model_id": (("unknown", "cross_entropy", None), {}, "unknown model_id 'unknown'"),
    "unknown loss": (("a", "nope", None), {}, "unknown loss function 'nope'"),
    "unknown config key": (("a", "ppo", {"eps": 0.2}), {}, "'eps' is not accepted by loss 'ppo'"),
    "targets length": (("a", "cross_entropy", None), {"targets": [1, 2]}, "target_tokens has shape [2]; it must be [5]"),
    "weights length": (("a", "cross_entropy", None), {"weights": [1.0]}, "weights has shape [1] but target_tokens has [5]"),
    "token id": (("a", "cross_entropy", None), {"input_ids": [1, 512, 3, 4, 5]}, "model_input[1] = 512 is outside"),
    "negative target": (("a", "cross_entropy", None), {"targets": [1, -1, 3, 4, 5]}, "target_tokens[1] = -1"),
    "empty": (("a", "cross_entropy", None), {"input_ids": [], "targets": [], "weights": []}, "empty sequence"),
    "too long": (("a", "cross_entropy", None), {"input_ids": [1] * 65, "targets": [1] * 65, "weights": [1.0] * 65},
                 "65 tokens exceeds max_seq_len=64"),
    "nan advantages": (("a", "ppo", None), {"advantages": [0.0, float("nan"), 0, 0, 0]}, "advantages[1] = nan"),
    "inf logprobs": (("a", "importance_sampling", None), {"logprobs": [0.0, 0, float("-inf"), 0, 0]},
                     "logprobs[2] = -inf"),
}


@pytest.mark.parametrize("method", ["forward_backward", "forward"])
def test_bad_inputs_fail_alone_and_change_nothing(tiny_dirs, method):
    backend = new_backend(tiny_dirs)
    good = random_datums(9, [7, 5])
    requests = [ce_request("good", "b", good)]
    for name, ((model_id, loss, config), changes, _) in BAD.items():
        datum = random_datums(10, [5])[0] | changes
        requests.append((name, model_id, [good[1], datum], loss, config))
    weights_a = slot_weights(backend, "a")
    out = getattr(backend, method)(make_batch(requests))
    for name, (_, _, message) in BAD.items():
        assert isinstance(out[name], types.ErrorResponse), name
        assert message in out[name].error, (name, out[name].error)
    alone = new_backend(tiny_dirs)
    want = getattr(alone, method)(make_batch([ce_request("good", "b", good)]))["good"]
    assert out["good"].metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-6)
    for k, v in slot_weights(backend, "a").items():
        assert np.array_equal(weights_a[k], v)
    assert not any(np.any(g) for g in backend.grad_sum_of("a").values())
    if method == "forward_backward":
        _assert_close_trees(backend.grad_sum_of("b"), alone.grad_sum_of("b"))
    else:
        assert not any(np.any(g) for g in backend.grad_sum_of("b").values())


def test_slots_create_delete_and_errors(tiny_dirs):
    backend = new_backend(tiny_dirs)
    with pytest.raises(ValueError, match="model_id 'a' already exists"):
        backend.create_model("a", types.LoraConfig(rank=2))
    with pytest.raises(ValueError, match="LoRA rank 9 must be in"):
        backend.create_model("c", types.LoraConfig(rank=9))
    with pytest.raises(ValueError):
        types.LoraConfig(rank=-1)
    with pytest.raises(ValueError, match="LoRA rank 0 means full training"):
        backend.create_model("c", types.LoraConfig(rank=0))
    backend.create_model("c", types.LoraConfig(rank=2))
    with pytest.raises(ValueError, match="no free adapter slot: all 3 slots are in use"):
        backend.create_model("d", types.LoraConfig(rank=2))
    step(backend, "a", random_datums(11, [6]), learning_rate=1e-2)
    slot = backend.models["a"].adapter_index
    backend.delete_model("a")
    assert not backend.has_model("a")
    with pytest.raises(KeyError, match="unknown model_id 'a'"):
        backend.optim_step("a", types.OptimStepInput())
    backend.create_model("d", types.LoraConfig(rank=3, seed=5))
    assert backend.models["d"].adapter_index == slot
    fresh = tx.JaxBackend(tiny_dirs["dense"], CONFIG)
    fresh.create_model("d", types.LoraConfig(rank=3, seed=5))
    fresh_slot = fresh.models["d"].adapter_index
    for k, v in slot_weights(backend, "d").items():
        other = slot_weights(fresh, "d")[k]
        assert np.array_equal(v, other), k  # a reused slot is exactly a fresh adapter
    assert fresh_slot == 1 and not any(np.any(g) for g in backend.grad_sum_of("d").values())


def test_hyperparameters_and_batch_sizes_do_not_recompile(tiny_dirs):
    backend = new_backend(tiny_dirs)
    for i, (lr, wd, clip) in enumerate([(1e-3, 0.0, 0.0), (5e-3, 0.1, 1.0), (2e-2, 0.01, 0.3)]):
        backend.forward_backward(make_batch([ce_request("r", "a", random_datums(i, [5 + i, 9 - i]))]))
        backend.optim_step("a", types.OptimStepInput(adam_params=types.AdamParams(
            learning_rate=lr, weight_decay=wd, grad_clip_norm=clip, beta1=0.5 + 0.1 * i)))
        backend.optim_step("b", types.OptimStepInput())
    assert backend.metrics.compiles == {"forward_backward": 1, "optim_step": 1}


def test_bf16_base_keeps_float32_lora_and_adam_state(tiny_dirs):
    backend = new_backend(tiny_dirs, dtype="bfloat16")
    assert backend.model.embed_tokens.embedding.get_value().dtype == np.dtype("bfloat16")
    out = step(backend, "a", random_datums(12, [9]), learning_rate=1e-2)
    assert np.isfinite(out)
    assert all(v.dtype == np.float32 for v in slot_weights(backend, "a").values())
    assert all(x.dtype in (np.float32, np.int32) for x in jax.tree.leaves(backend.opt_state_of("a")))
    logprobs = backend.forward(make_batch([ce_request("r", "a", random_datums(13, [6]))]))["r"]
    assert logprobs.loss_fn_outputs[0]["logprobs"].dtype == "float32"


def test_sharded_backend_equals_single_device(tiny_dirs):
    requests = [ce_request("ra", "a", random_datums(14, [12, 5, 9])), ce_request("rb", "b", random_datums(15, [7]))]
    single = new_backend(tiny_dirs)
    sharded = new_backend(tiny_dirs, fully_sharded_data_parallel_size=2, expert_parallel_size=2, tensor_parallel_size=2)
    for backend in (single, sharded):
        out = backend.forward_backward(make_batch(requests))
        backend.optim_step("a", types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-2, weight_decay=0.1)))
        backend.outputs = out
    for request_id in ("ra", "rb"):
        for x, y in zip(single.outputs[request_id].loss_fn_outputs, sharded.outputs[request_id].loss_fn_outputs):
            np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), atol=2e-5)
    _assert_close_trees(single.grad_sum_of("b"), sharded.grad_sum_of("b"), rtol=1e-4)
    after_single, after_sharded = slot_weights(single, "a"), slot_weights(sharded, "a")
    for k in after_single:
        np.testing.assert_allclose(after_single[k], after_sharded[k], atol=1e-5)
