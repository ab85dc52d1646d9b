"""Test helpers: the tests' one-device mesh default, reference log-probs from transformers, batches, PEFT
weight extraction."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re

import numpy as np

# The tests' mesh: backends built in a test process run on ONE device unless the test sizes a mesh itself (the
# process has 8 virtual CPU devices for the tests that do). tests/conftest.py applies this as the default of
# JaxBackendConfig's fsdp size for the whole session (`pin_mesh_default`): every backend a test builds, also
# through the SFT / RL trainers (their mesh sizes default to the backend's), then compiles for one device.
# A test that wants the production default (every device) uses `production_mesh_default()`.
ONE_DEVICE = {"fully_sharded_data_parallel_size": 1}
FSDP_FIELD = "fully_sharded_data_parallel_size"


def _set_fsdp_default(value: int) -> int:
    """Set JaxBackendConfig's default fsdp size (rebuilding its validator); the previous default."""
    from tx.backends.config import JaxBackendConfig

    field = JaxBackendConfig.model_fields[FSDP_FIELD]
    before, field.default = field.default, value
    JaxBackendConfig.model_rebuild(force=True)
    if JaxBackendConfig().fully_sharded_data_parallel_size != value:  # pydantic changed how defaults are kept
        raise RuntimeError(f"could not set the tests' default {FSDP_FIELD}={value}")
    return before


def pin_mesh_default() -> None:
    """Make one device the default mesh of every JaxBackendConfig built in this process (tests/conftest.py)."""
    _set_fsdp_default(ONE_DEVICE[FSDP_FIELD])


@contextlib.contextmanager
def production_mesh_default():
    """Within: JaxBackendConfig's fsdp size defaults to what users get (-1: every device)."""
    from tx.models.sharding import AUTO

    before = _set_fsdp_default(AUTO)
    try:
        yield
    finally:
        _set_fsdp_default(before)


# The tests' MoE kernel on CPU: most MoE models in the test processes run XLA's `ragged_dot` (GPU's "auto" pick)
# instead of CPU's "auto" pick, the `blocked` kernel, whose loops make a tiny MoE training step compile ~7x slower
# (23 s instead of 2 s; the suite's MoE tests took ~2x as long). tests/conftest.py sets this for the session
# (`tx.models.layers.moe.MODEL_AUTO_IMPL`; the kernels' own `resolve_impl` is unchanged); the tests marked
# `production_moe_kernel` (pyproject.toml's markers) build their models with tx's own pick, and
# tests/kernels/test_gmm.py checks `blocked` against numpy. Subprocesses (servers, `tx.run`, `tx.score`) are not
# pinned: they run tx's own pick.
TESTS_CPU_MOE_IMPL = "ragged_dot"


def set_cpu_moe_auto(impl: str | None) -> None:
    """Make `impl` what MoE models built with moe_impl="auto" run on CPU in this process (None: tx's own pick,
    `blocked`); `tx.kernels.gmm.resolve_impl` itself is not changed."""
    from tx.models.layers.moe import MODEL_AUTO_IMPL

    if impl is None:
        MODEL_AUTO_IMPL.pop("cpu", None)
    else:
        MODEL_AUTO_IMPL["cpu"] = impl


def cpu_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process on `devices` virtual CPU devices, with XLA's CPU code generation
    unoptimised (`--xla_backend_optimization_level=0`: ~30% faster compiles) and its loop emitters in place
    of the MLIR fusion emitters (`--xla_cpu_use_fusion_emitters=false`: a tiny model's training step compiles
    in 3.1 s instead of 6.5 s, and runs as fast; jaxlib 0.11.2 no longer knows the flag and would abort on it),
    LLVM's expensive passes skipped and each program's code generated on one thread (the test processes already
    share the 2 cores): alone, tests/rl/test_trainer.py + tests/api/test_recipes.py 103 -> 92 s and tests/backends/
    test_jax_backend.py 51 -> 44 s; the whole suite's time moved within run-to-run noise. The tests check
    numbers and programs, not speed (the collective counts of tests/models/test_collectives.py are the same
    either way)."""
    flags = (f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
             " --xla_llvm_disable_expensive_passes=true --xla_cpu_parallel_codegen_split_count=1")
    jaxlib = tuple(int(p) for p in re.findall(r"\d+", importlib.metadata.version("jaxlib"))[:3])
    return flags + " --xla_cpu_use_fusion_emitters=false" if jaxlib <= (0, 11, 0) else flags


def one_device_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) for a subprocess that runs tx on one CPU device (the conftest pin does
    not reach into subprocesses; tests/api/server_proc.py does the same for its servers)."""
    return {**(os.environ if env is None else env), "XLA_FLAGS": cpu_xla_flags(1), "JAX_PLATFORMS": "cpu"}


_ZEROS = np.zeros  # numpy's own, for `aligned_zeros` while tests patch `np.zeros`


def aligned_zeros(shape, dtype=float, order="C", **kwargs) -> np.ndarray:
    """`np.zeros` whose data starts 64-byte aligned, as glibc's heap hands out by chance: jax on CPU wraps such
    a host array without copying, and a wrapped buffer cannot be donated. Tests patch `np.zeros` with it."""
    dtype, size = np.dtype(dtype), int(np.prod(shape))
    raw = _ZEROS(size * dtype.itemsize + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + size * dtype.itemsize].view(dtype).reshape(shape, order=order)


def resident_bytes(array) -> int:
    """Bytes of the whole memory pages inside `array`'s CPU shards that are resident now (Linux `mincore`)."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for shard in array.addressable_shards:
        start = shard.data.unsafe_buffer_pointer()
        first, end = -(-start // page) * page, (start + shard.data.nbytes) // page * page
        vec = ctypes.create_string_buffer((end - first) // page)
        assert libc.mincore(first, end - first, vec) == 0
        total += page * sum(b & 1 for b in vec.raw)
    return total


def random_batch(seed: int, lengths: list[int], vocab: int, pad_to: int | None = None):
    """Right-padded ids, mask and next-token targets for sequences of the given lengths."""
    rng = np.random.default_rng(seed)
    t = pad_to or max(lengths)
    ids = np.zeros((len(lengths), t), np.int32)
    mask = np.zeros((len(lengths), t), np.int32)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(0, vocab, n)
        mask[i, :n] = 1
    targets = np.roll(ids, -1, axis=1) * mask
    return ids, mask, targets


def hf_logprobs(model, ids: np.ndarray, mask: np.ndarray, targets: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, torch.tensor(targets, dtype=torch.long)[..., None])[..., 0].numpy()


def assert_logprobs_match_hf(model, hf, seed: int, lengths: list[int], vocab: int = 512, tol: float = 1e-4) -> None:
    """The tx model's base log-probs of random right-padded rows equal transformers' `hf` within `tol` (and are not
    trivially uniform)."""
    import jax.numpy as jnp

    ids, mask, targets = random_batch(seed, lengths, vocab)
    adapters = jnp.zeros(len(lengths), jnp.int32)
    hidden = model(jnp.asarray(ids), jnp.asarray(mask), adapters)
    got = np.asarray(model.target_logprobs(hidden, jnp.asarray(targets), adapters))
    want = hf_logprobs(hf, ids, mask, targets)
    valid = mask.astype(bool)
    assert np.abs(got - want)[valid].max() <= tol
    assert np.abs(want[valid] - want[valid].mean()).max() > 1e-2


def peft_weights(peft_model) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{hf module name: (A [r, in], B [out, r])} of a PEFT model's default adapter."""
    out = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            out[name.removeprefix("base_model.model.")] = (
                module.lora_A["default"].weight.detach().numpy().copy(),
                module.lora_B["default"].weight.detach().numpy().copy(),
            )
    return out


def make_batch(requests, **overrides):
    """A PreparedModelPassBatch from [(request_id, model_id, [datum, ...], loss_fn, loss_fn_config)], where a
    datum is a dict with input_ids and targets, and optionally weights, logprobs, advantages."""
    from tx import types

    fields = {k: [] for k in ("all_input_ids", "all_targets", "all_token_weights", "all_sampling_logprobs",
                              "all_advantages", "all_model_ids", "all_loss_fns", "all_loss_fn_configs")}
    slices = []
    for request_id, model_id, datums, loss_fn, config in requests:
        start = len(fields["all_input_ids"])
        for d in datums:
            n = len(d["input_ids"])
            fields["all_input_ids"].append(list(d["input_ids"]))
            fields["all_targets"].append(list(d["targets"]))
            fields["all_token_weights"].append(list(d.get("weights", [1.0] * n)))
            fields["all_sampling_logprobs"].append(list(d.get("logprobs", [])))
            fields["all_advantages"].append(list(d.get("advantages", [])))
            fields["all_model_ids"].append(model_id)
            fields["all_loss_fns"].append(loss_fn)
            fields["all_loss_fn_configs"].append(config)
        slices.append((request_id, model_id, start, len(fields["all_input_ids"])))
    return types.PreparedModelPassBatch(**fields, request_batch_slices=slices, **overrides)


def random_datums(seed: int, lengths: list[int], vocab: int = 512, **extra):
    """Datums of random token sequences; targets are the next tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        seq = rng.integers(0, vocab, n + 1)
        datum = {"input_ids": seq[:-1].tolist(), "targets": seq[1:].tolist()}
        for key, fn in extra.items():
            datum[key] = fn(rng, n)
        out.append(datum)
    return out


def peft_model_of(model_dir, weights: dict, rank: int, alpha: float, base=None):
    """transformers' float32 model at `model_dir` (or `base`, that model already loaded) under PEFT with one LoRA
    adapter holding `weights` ({module name: (A [r, in], B [out, r])}, as
    `tx.models.adapters.get_adapter_weights` returns them)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = base or AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=sorted(weights),
                                           init_lora_weights=False))
    with torch.no_grad():
        for name, module in peft.named_modules():
            key = name.removeprefix("base_model.model.")
            if key in weights:
                module.lora_A["default"].weight.copy_(torch.tensor(weights[key][0]))
                module.lora_B["default"].weight.copy_(torch.tensor(weights[key][1]))
    return peft


GREEDY_PROMPT = [5, 17, 99, 3, 42, 7]  # what `train_and_check_two_adapters` samples from


def train_and_check_two_adapters(backend, model_dir, reference, tol: float = 1e-4) -> dict:
    """Adapters "a" (rank 8, every module) and "b" (rank 4, no MLP) trained three cross-entropy steps each in
    `backend`; then each one's forward log-probs equal its reference's within `tol` and greedy sampling (12 tokens)
    from `GREEDY_PROMPT` equals the reference's `generate`, where `reference(model_dir, weights, rank, alpha)` is a transformers model
    holding the adapter's weights. Returns {model_id: (greedy tokens, their sampled log-probs)}."""
    import torch

    from tests.sampling.test_sample import SP, sample_batch
    from tx import types
    from tx.models.adapters import get_adapter_weights

    backend.create_model("a", types.LoraConfig(rank=8, alpha=16, seed=1))
    backend.create_model("b", types.LoraConfig(rank=4, alpha=8, seed=2, train_mlp=False))
    train = random_datums(0, [70, 12])
    for _ in range(3):
        for model_id in ("a", "b"):
            out = backend.forward_backward(make_batch([("r", model_id, train, "cross_entropy", None)]))["r"]
            assert isinstance(out, types.ForwardBackwardOutput), out
            backend.optim_step(model_id, types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-2)))
    datums = random_datums(1, [80, 9])
    samples = {}
    for model_id in ("a", "b"):
        meta = backend.models[model_id]
        weights = get_adapter_weights(backend.model, meta.adapter_index, meta.lora_config.rank)
        ref = reference(model_dir, weights, meta.lora_config.rank, meta.lora_config.alpha)
        out = backend.forward(make_batch([("f", model_id, datums, "cross_entropy", None)]))["f"]
        for datum, output in zip(datums, out.loss_fn_outputs):
            ids = np.array([datum["input_ids"]])
            want = hf_logprobs(ref, ids, np.ones_like(ids), np.array([datum["targets"]]))[0]
            assert np.abs(output["logprobs"].to_numpy() - want).max() <= tol, model_id
        sampled = backend.sample(sample_batch([("s", model_id, [(GREEDY_PROMPT, SP(max_tokens=12, temperature=0.0))],
                                                False, 0)]))["s"].sequences[0]
        with torch.no_grad():
            want_tokens = ref.generate(torch.tensor([GREEDY_PROMPT]), max_new_tokens=12, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(GREEDY_PROMPT):].tolist()
        assert sampled.tokens == want_tokens, model_id
        # the sampled tokens' log-probs are the training forward's on the same sequence
        seq = GREEDY_PROMPT + sampled.tokens
        scored = backend.forward(make_batch([("g", model_id, [{"input_ids": seq[:-1], "targets": seq[1:]}],
                                              "cross_entropy", None)]))["g"].loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(np.asarray(sampled.logprobs), scored[-len(sampled.tokens):], atol=tol)
        samples[model_id] = (sampled.tokens, np.asarray(sampled.logprobs))
    return samples
