"""FullBackend (training_mode="full"): gradients and AdamW steps of every base weight against transformers +
torch.optim.AdamW, one live model, restoring the base weights, base sampling refused, gradient
accumulation, bf16 masters, a (2, 2, 2) mesh against one device, exact resume and sampler saves."""

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

import tx
from tests.helpers import make_batch, random_datums
from tx import types
from tx.backends.full import FullBackend, backend_class
from tx.backends.full_state import split_full
from tx.checkpoints.full import open_sampler_model

FP32 = tx.JaxBackendConfig(training_mode="full", max_seq_len=64, mixed_precision={"param_dtype": "fp32"})
# eps well above float32 noise of the gradients (~1e-7): Adam divides by |g| + eps, so with a tiny eps an
# element whose gradient cancels to ~0 would amplify summation-order noise into a visible update difference.
ADAM = dict(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-4, weight_decay=0.1, grad_clip_norm=1.0)


def new_backend(path, **overrides) -> FullBackend:
    backend = FullBackend(path, FP32.model_copy(update=overrides))
    backend.create_model("m", types.LoraConfig(rank=1))
    return backend


def weighted_datums(seed, lengths):
    return random_datums(seed, lengths, weights=lambda rng, n: rng.uniform(0.2, 1.5, n).tolist())


def ce(request_id, datums, model_id="m"):
    return (request_id, model_id, datums, "cross_entropy", None)


def as_hf(flat: dict[str, np.ndarray], backend: FullBackend) -> dict[str, np.ndarray]:
    """tx's `{"dotted.path": array}` of base weights (or their gradients) under HF names and layouts,
    written here independently of tx's loader: layers unstacked, `[in, out]` kernels transposed, experts in
    transformers 5's fused layout (`gate_up_proj [E, 2F, D]`, `down_proj [E, D, F]`)."""
    out, gate_up = {}, {}
    for dotted, value in flat.items():
        path = dotted.split(".")
        value = np.asarray(value, np.float32)
        if path[0] != "stacks":
            name = {"embed_tokens.embedding": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                    "lm_head.kernel": "lm_head.weight"}[dotted]
            out[name] = value.T if path[-1] == "kernel" else value
            continue
        rest = path[3:]
        for j, i in enumerate(backend.model.stacks[int(path[1])].layer_ids):
            x = np.swapaxes(value[j], -1, -2) if rest[-1] == "kernel" else value[j]
            prefix = f"model.layers.{i}."
            if rest[:2] == ["mlp", "experts"]:
                if rest[2] == "down_proj":
                    out[prefix + "mlp.experts.down_proj"] = x
                else:
                    gate_up.setdefault(prefix, {})[rest[2]] = x
            else:
                out[prefix + ".".join(rest[:-1]) + ".weight"] = x
    for prefix, parts in gate_up.items():
        out[prefix + "mlp.experts.gate_up_proj"] = np.concatenate([parts["gate_proj"], parts["up_proj"]], axis=1)
    return out


def weights_of(backend: FullBackend, model_id: str = "m") -> dict[str, np.ndarray]:
    state = backend.master_weights(model_id)
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def torch_sum_loss(model, datums) -> torch.Tensor:
    """Tinker's cross_entropy: sum over tokens of -log p(target) * weight (no normalisation)."""
    total = 0.0
    for d in datums:
        logits = model(input_ids=torch.tensor([d["input_ids"]])).logits[0].float()
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(d["targets"])[:, None])[:, 0]
        total = total + (-logp * torch.tensor(d["weights"], dtype=torch.float32)).sum()
    return total


def assert_close(got: dict, want: dict, rel: float, what: str):
    """Per tensor: max |got - want| <= rel * max |want| (elementwise relative error is meaningless where a
    value crosses zero)."""
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for name in want:
        scale = np.abs(want[name]).max()
        err = np.abs(got[name] - want[name]).max()
        assert err <= rel * scale, f"{what} {name}: max|diff| {err:.3g} > {rel} * max|ref| {scale:.3g}"


MESH_222 = dict(fully_sharded_data_parallel_size=2, expert_parallel_size=2, tensor_parallel_size=2)


@pytest.mark.parametrize("kind,mesh", [("dense", {}), ("moe", {}), ("moe", MESH_222), ("llama", {})],
                         ids=["dense", "moe", "moe-222", "llama"])
@pytest.mark.production_moe_kernel
def test_full_steps_match_torch_adamw(tiny_dirs, family_dirs, kind, mesh):
    """Gradient sums after one forward_backward, then the weights after 1 and 3 optim_steps on the same batch,
    equal transformers + torch.optim.AdamW (same lr, betas, eps, weight decay, clip_grad_norm_) to 1e-5 of each
    tensor's scale in float32. MoE: router and scanned per-layer expert kernels included. The (2, 2, 2) mesh on
    8 CPU devices meets the same 1e-5 bound after one step, so it equals one device to 2e-5; its Adam moments
    are sharded like the weights."""
    datums = weighted_datums(0, [11, 7, 5, 4])
    model_dir = {**tiny_dirs, **family_dirs}[kind]  # llama: Llama 3 (no q/k norms, Llama 3.1 RoPE)
    backend = new_backend(model_dir, **mesh)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = dict(hf.named_parameters())
    before = {k: v.detach().numpy().copy() for k, v in params.items()}
    opt = torch.optim.AdamW(params.values(), lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]),
                            eps=ADAM["eps"], weight_decay=ADAM["weight_decay"])
    for step in range(1 if mesh else 3):  # the (2, 2, 2) mesh: one step (its compile is the cost)
        out = backend.forward_backward(make_batch([ce("r", datums)]))["r"]
        opt.zero_grad()
        loss = torch_sum_loss(hf, datums)
        loss.backward()
        assert out.metrics["loss:sum"] == pytest.approx(loss.item(), rel=1e-5)
        if step == 0:
            grads = {k: v.grad.numpy() for k, v in params.items()}
            assert_close(as_hf(backend.grad_sum_of("m"), backend), grads, 1e-5, "gradient")
        torch.nn.utils.clip_grad_norm_(params.values(), ADAM["grad_clip_norm"])
        opt.step()
        metrics = backend.optim_step("m", types.OptimStepInput(adam_params=types.AdamParams(**ADAM))).metrics
        assert metrics["grad_clip_scale"] < 1  # clipping is exercised
        if step in (0, 2) or mesh:
            want = {k: v.detach().numpy() for k, v in params.items()}
            got = as_hf(weights_of(backend), backend)
            assert_close(got, want, 1e-5, f"weights after {step + 1} steps")
    moved = max(np.abs(want[k] - before[k]).max() for k in want)
    assert moved > 1e-3  # the weights moved ~100x the tolerance (lr 1e-3 per step)
    mu, params = backend.opt_state_of("m")[0].mu, backend.master_weights("m")
    for (_, m), (_, p) in zip(nnx.to_flat_state(mu), nnx.to_flat_state(params)):
        assert m.get_value().sharding.is_equivalent_to(p.get_value().sharding, p.get_value().ndim)


def sample_batch(model_id, prompt):
    params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    return types.PreparedSampleBatch(all_prompts=[prompt], all_sampling_params=[params], all_model_ids=[model_id],
                                     all_checkpoint_ids=[""], all_checkpoint_paths=[""],
                                     request_batch_slices=[("s", model_id, 0, 1, True, 0)])


def test_one_model_base_sampling_refused_trained_sampling_and_delete_restores_base(tiny_dirs):
    """A second create_model names the live model; sampling "" is refused; sampling the model reads its trained
    weights; delete_model restores the base weights bit for bit (a fresh backend's forward log-probs)."""
    backend = new_backend(tiny_dirs["dense"])
    with pytest.raises(ValueError, match="model 'm' is live"):
        backend.create_model("n", types.LoraConfig(rank=1))
    refused = backend.sample(sample_batch("", [1, 2, 3]))["s"]
    assert isinstance(refused, types.ErrorResponse) and "base model (model id '') cannot be sampled" in refused.error
    datums = weighted_datums(1, [9, 6])
    backend.forward_backward(make_batch([ce("r", datums)]))
    backend.optim_step("m", types.OptimStepInput(adam_params=types.AdamParams(**ADAM)))
    trained = backend.forward(make_batch([ce("f", datums)]))["f"].loss_fn_outputs[0]["logprobs"].to_numpy()
    # sampling reads the trained weights: prompt_logprobs[i] scores prompt token i, forward's logprobs[i-1]
    out = backend.sample(sample_batch("m", datums[0]["input_ids"]))["s"]
    assert isinstance(out, types.SampleOutput) and len(out.sequences[0].tokens) == 4, out
    np.testing.assert_allclose(np.asarray(out.prompt_logprobs[1:], np.float32), trained[:-1], atol=2e-5)
    backend.delete_model("m")
    assert not backend.has_model("m")
    gone = backend.forward_backward(make_batch([ce("r", datums)]))["r"]
    assert isinstance(gone, types.ErrorResponse) and "unknown model_id 'm'" in gone.error
    with pytest.raises(KeyError, match="unknown model_id 'm'"):
        backend.optim_step("m", types.OptimStepInput())
    backend.create_model("n", types.LoraConfig(rank=1))
    fresh = new_backend(tiny_dirs["dense"])
    for a, b in zip(weights_of(fresh).values(), weights_of(backend, "n").values()):
        assert np.array_equal(a, b)  # the base weights, re-read: bit-identical
    got = backend.forward(make_batch([ce("f", datums, "n")]))["f"].loss_fn_outputs[0]["logprobs"].to_numpy()
    want = fresh.forward(make_batch([ce("f", datums)]))["f"].loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.array_equal(got, want) and not np.allclose(got, trained, atol=1e-4)


def test_unknown_ids_and_config_errors(tiny_dirs):
    backend = new_backend(tiny_dirs["dense"])
    out = backend.forward(make_batch([ce("r", random_datums(2, [4]), "other")]))["r"]
    assert isinstance(out, types.ErrorResponse) and "unknown model_id 'other'" in out.error and "'m'" in out.error
    with pytest.raises(ValueError, match="served by tx.backends.full.FullBackend"):
        tx.JaxBackend(tiny_dirs["dense"], FP32)
    with pytest.raises(ValueError, match="mixed_precision applies to training_mode='full' only"):
        tx.JaxBackendConfig(mixed_precision={"param_dtype": "fp32"})
    with pytest.raises(ValueError, match="dtype='float32'"):
        tx.JaxBackendConfig(training_mode="full", dtype="float32")
    shorthand = tx.JaxBackendConfig(training_mode="full", mixed_precision="fp32").mixed_precision  # the CLI flag
    assert shorthand.param_dtype == "fp32" and shorthand.reduce_dtype == "fp32"
    with pytest.raises(ValueError, match="param_dtype"):
        tx.JaxBackendConfig(training_mode="full", mixed_precision="fp16")
    assert backend_class(FP32) is FullBackend and backend_class(tx.JaxBackendConfig()) is tx.JaxBackend


def test_gradient_accumulation_across_calls_equals_one_call(tiny_dirs):
    """Two forward_backward calls sum into the same float32 gradient sums as one call with both datums (here
    split into two micro-batches by train_micro_batch_size=2), to 1e-5."""
    backend = new_backend(tiny_dirs["dense"], train_micro_batch_size=2)
    a, b = weighted_datums(4, [10, 12]), weighted_datums(5, [6, 3])
    backend.forward_backward(make_batch([ce("r1", a)]))
    backend.forward_backward(make_batch([ce("r2", b)]))
    split = backend.grad_sum_of("m")
    before = weights_of(backend)
    no_op = types.AdamParams(**{**ADAM, "learning_rate": 0.0, "weight_decay": 0.0})
    metrics = backend.optim_step("m", types.OptimStepInput(adam_params=no_op)).metrics
    assert metrics["accumulated_sequences"] == 4
    assert all(np.array_equal(before[k], v) for k, v in weights_of(backend).items())  # lr 0: weights kept
    assert all(np.all(v == 0) for v in backend.grad_sum_of("m").values())  # the step consumed the sums
    backend.forward_backward(make_batch([ce("r", a + b)]))
    assert_close(split, backend.grad_sum_of("m"), 1e-5, "accumulated gradient")


def test_bf16_params_keep_float32_masters_and_moments(tiny_dirs):
    backend = FullBackend(tiny_dirs["dense"], tx.JaxBackendConfig(training_mode="full", max_seq_len=64))
    backend.create_model("m", types.LoraConfig(rank=1))
    backend.forward_backward(make_batch([ce("r", weighted_datums(6, [7]))]))
    assert all(v.dtype == np.float32 for v in backend.grad_sum_of("m").values())
    backend.optim_step("m", types.OptimStepInput(adam_params=types.AdamParams(**ADAM)))
    masters = weights_of(backend)
    assert all(v.dtype == np.float32 for v in masters.values())
    leaves = [x for x in jax.tree.leaves(backend.opt_state_of("m")) if x.ndim]
    assert leaves and all(x.dtype == np.float32 for x in leaves)
    model = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(split_full(backend.model)[1])}
    for k, m in masters.items():
        assert str(model[k].dtype) == "bfloat16"
        assert np.array_equal(model[k], m.astype(model[k].dtype))  # the model computes with bf16(master)


def test_state_bytes_are_split_over_fsdp(tiny_dirs):
    """Per device, weights + gradient sums + Adam moments of the (2, 1, 1) mesh are those of one device / 2
    (plus what is replicated: the norms' scales, < 1% here)."""
    single = new_backend(tiny_dirs["dense"])
    one, n_params = single.state_bytes(), sum(v.size for v in weights_of(single).values())
    two = new_backend(tiny_dirs["dense"], fully_sharded_data_parallel_size=2).state_bytes()
    assert one["params"] == one["grad_sums"] == 4 * n_params and one["adam"] >= 8 * n_params and one["masters"] == 0
    for kind in ("params", "grad_sums", "adam"):
        assert one[kind] / 2 <= two[kind] <= one[kind] / 2 + 0.02 * one[kind]


def sample_path_batch(model_id, prompt, path):
    batch = sample_batch(model_id, prompt)
    return batch.model_copy(update={"all_checkpoint_paths": [path], "all_checkpoint_ids": [path]})


def test_exact_resume_and_sampler_saves(tiny_dirs, tmp_path):
    """bf16 params with float32 masters: save after step 1, a new backend loads it and takes steps 2 and 3 ==
    the uninterrupted run, bit for bit (masters, model weights, Adam state). A sampler save samples the
    live weights until they change, then is refused by name; a failed load changes nothing."""
    config = tx.JaxBackendConfig(training_mode="full", max_seq_len=64)
    hp = types.OptimStepInput(adam_params=types.AdamParams(**ADAM))
    batches = [make_batch([ce("r", weighted_datums(10 + i, [8, 5]))]) for i in range(3)]

    def run(backend, steps):
        for b in steps:
            backend.forward_backward(b)
            backend.optim_step("m", hp)

    first = FullBackend(tiny_dirs["dense"], config)
    first.create_model("m", types.LoraConfig(rank=0))
    run(first, batches[:1])
    first.save_checkpoint(tmp_path / "ckpt", "m")
    first.forward_backward(batches[1])  # accumulated but not stepped: not part of the checkpoint
    resumed = FullBackend(tiny_dirs["dense"], config)
    resumed.create_model("m", types.LoraConfig(rank=0))
    resumed.forward_backward(batches[2])  # the load drops these sums
    before = weights_of(resumed)
    with pytest.raises(Exception, match="ckpt-missing"):
        resumed.load_checkpoint(tmp_path / "ckpt-missing", "m")
    assert all(np.array_equal(before[k], v) for k, v in weights_of(resumed).items())
    resumed.load_checkpoint(tmp_path / "ckpt", "m")
    assert resumed.models["m"].optim_steps == 1
    assert all(np.all(v == 0) for v in resumed.grad_sum_of("m").values())
    first.optim_step("m", hp)
    run(first, batches[2:])
    run(resumed, batches[1:])
    for a, b in ((weights_of(first), weights_of(resumed)),
                 (dict(enumerate(jax.tree.leaves(first.opt_state_of("m")))),
                  dict(enumerate(jax.tree.leaves(resumed.opt_state_of("m"))))),
                 (dict(enumerate(jax.tree.leaves(split_full(first.model)[1]))),
                  dict(enumerate(jax.tree.leaves(split_full(resumed.model)[1]))))):
        assert a.keys() == b.keys() and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)

    prompt = weighted_datums(1, [9])[0]["input_ids"]
    live = first.sample(sample_batch("m", prompt))["s"]
    first.save_sampler_checkpoint(str(tmp_path / "s1.tar"), "m", persist=True)
    first.save_sampler_checkpoint(str(tmp_path / "s2"), "m", persist=False)
    for path in ("s1.tar", "s2"):
        out = first.sample(sample_path_batch("m", prompt, str(tmp_path / path)))["s"]
        assert isinstance(out, types.SampleOutput) and out.sequences[0].tokens == live.sequences[0].tokens
    with open_sampler_model(tmp_path / "s1.tar") as (hf_dir, meta):
        assert meta["optim_steps"] == 3 and meta["model_id"] == "m"
        assert (hf_dir / "model.safetensors.index.json").exists() and (hf_dir / "config.json").exists()
    unknown = first.sample(sample_path_batch("m", prompt, str(tmp_path / "other")))["s"]
    assert isinstance(unknown, types.ErrorResponse) and "not a save of them" in unknown.error
    run(first, batches[:1])
    stale = first.sample(sample_path_batch("m", prompt, str(tmp_path / "s1.tar")))["s"]
    assert isinstance(stale, types.ErrorResponse) and "weights of step 3, which have changed since (now at step 4)" \
        in stale.error
