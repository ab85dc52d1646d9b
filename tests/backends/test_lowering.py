"""Every compiled program that runs the model, lowered for TPU and CUDA from this CPU host (`jax.export`).

The programs are the ones the backends and the sampler jit, built by the same factories
(`steps.make_model_pass`, `steps.make_optim_step`, `full_state.make_full_optim_step`, the jitted `commit_grads`,
`paged_step.prefill_chunk` / `decode_steps`, `prompt_scores.score_prompts`) from a tiny
MoE model loaded the way the backend loads it (`load_model` on the mesh, its "auto" kernels), with the
inputs' shapes and shardings of a real call. Only the model's platform differs from what a CPU backend
builds: "tpu" or "cuda" instead of its mesh's "cpu".

- tpu, 8-device (fsdp, ep, tp) meshes (2, 2, 2), (1, 1, 8) and (8, 1, 1): splash attention (forward, dq,
  dkv), megablox and the ragged paged attention kernel are compiled (Mosaic `tpu_custom_call`s whose block
  shapes pass Mosaic's lowering), each inside its layer's shard_map (GSPMD cannot partition a Mosaic call;
  tests/kernels/test_lowering.py). The page pools are laid out as the engine lays them out.
- cuda, a (2, 2, 2) mesh: no Pallas TPU kernel; bfloat16 attention goes to cuDNN (a stand-in here, since
  tracing cuDNN needs a GPU), float32 to blockwise.
- no program calls back into Python on the host.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.lowering import MOSAIC, abstract, assert_no_host_callbacks, custom_calls, lower, mosaic_kernels
from tx import losses, types
from tx.backends import batching, full_state, steps
from tx.backends.full_state import make_full_optim_step, split_full
from tx.backends.steps import adamw, make_model_pass, make_optim_step, split_model, take_slot
from tx.kernels import attention as attn
from tx.models.config import LoraSlots
from tx.models.layers.attention import POOL_AXES
from tx.models.loading import load_model
from tx.models.sharding import batch_spec, make_mesh
from tx.sampling.paged_step import PrefillInputs, SlotInputs, decode_steps, prefill_chunk
from tx.sampling.prompt_scores import PromptScoreInputs, score_prompts

# target id -> (platform, (fsdp, ep, tp))
TARGETS = {"tpu-2x2x2": ("tpu", (2, 2, 2)), "tpu-1x1x8": ("tpu", (1, 1, 8)), "tpu-8x1x1": ("tpu", (8, 1, 1)),
           "cuda-2x2x2": ("cuda", (2, 2, 2))}
PAGED_IMPL = {"tpu": "pallas", "cuda": "blocked"}
SEQ, PAGE, PAGES, WIDTH = 32, 16, 16, 4


def _no_trace_count():
    return None


@dataclasses.dataclass
class Target:
    platform: str
    mesh: Any
    rows: int
    lora_model: Any  # float32, LoRA slots (JaxBackend)
    full_model: Any  # bfloat16, expert kernels scanned (FullBackend's default precision)

    def batch(self, shape_of: dict[str, np.ndarray]) -> dict[str, jax.ShapeDtypeStruct]:
        """A host batch's arrays as the backend places them: rows over fsdp (`batch_spec`)."""
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(self.mesh, batch_spec(v.ndim)))
                for k, v in shape_of.items()}

    def replicated(self, shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, P()))


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request, tiny_dirs) -> Target:
    platform, (fsdp, ep, tp) = TARGETS[request.param]
    mesh = make_mesh(fsdp, ep, tp, jax.devices()[: fsdp * ep * tp])
    lora_model = load_model(tiny_dirs["moe"], LoraSlots(max_lora_adapters=3, max_lora_rank=2), mesh, platform=platform)
    full_model = load_model(tiny_dirs["moe"], LoraSlots(max_lora_adapters=2, max_lora_rank=1), mesh, dtype="bfloat16",
                            experts_whole=False, platform=platform)
    assert lora_model.platform == full_model.platform == platform
    return Target(platform, mesh, 2 * fsdp, lora_model, full_model)


def _pass_batch(t: Target) -> dict:
    return t.batch(batching.pack([], t.rows, SEQ, losses.names()))


def _hp() -> dict:
    return {k: jnp.float32(v) for k, v in types.AdamParams().model_dump().items()}


# Each builder: (the jitted program, its abstract arguments[, its static keyword arguments]) for a target.


def lora_pass(mode: str) -> Callable[[Target], tuple]:
    def build(t: Target):
        graphdef, lora, frozen = split_model(t.lora_model)
        fn = make_model_pass(graphdef, 16, mode, _no_trace_count, None, losses.extra_input_keys())
        args = (abstract(lora), abstract(frozen)) + ((abstract(lora),) if mode == "accumulate" else ())
        return fn, (*args, _pass_batch(t))
    return build


def lora_optim_step(t: Target):
    """AdamW on slot 1, its state shaped like one slot (`init_opt_state`, abstractly)."""
    _, lora, _ = split_model(t.lora_model)
    one_slot = jax.eval_shape(lambda tree: take_slot(tree, jnp.int32(1)), lora)
    return make_optim_step(_no_trace_count), (abstract(lora), abstract(lora), _adam_state(one_slot, t), jnp.int32(1),
                                             _hp())


def lora_commit_grads(t: Target):
    """A call's gradients added into the sums of the allowed slots (after its last micro-batch)."""
    _, lora, _ = split_model(t.lora_model)
    allowed = t.replicated((t.lora_model.slots.max_lora_adapters,), jnp.bool_)
    return steps.commit_grads, (abstract(lora), abstract(lora), allowed)


def full_commit_grads(t: Target):
    _, params, _ = split_full(t.full_model)
    sums = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding), params)
    return full_state.commit_grads, (sums, sums)


def full_pass(mode: str) -> Callable[[Target], tuple]:
    def build(t: Target):
        graphdef, params, rest = split_full(t.full_model)
        fn = make_model_pass(graphdef, 16, mode, _no_trace_count, jnp.float32, losses.extra_input_keys())
        sums = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding), params)
        args = (abstract(params), abstract(rest)) + ((sums,) if mode == "accumulate" else ())
        return fn, (*args, _pass_batch(t))
    return build


def full_optim_step(t: Target):
    """bf16 weights with float32 masters (FullBackend's default precision)."""
    _, params, _ = split_full(t.full_model)
    master = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding), params)
    fn = make_full_optim_step(jnp.bfloat16, _no_trace_count)
    return fn, (master, abstract(params), master, _adam_state(master, t), _hp())


def _adam_state(master, t: Target):
    """`steps.init_adamw_state(master)` / `init_opt_state` abstractly: the moments float32 and shaped (and
    sharded) like `master`, the step count replicated."""
    state = jax.eval_shape(lambda m: adamw(dict.fromkeys(("learning_rate", "beta1", "beta2", "eps", "weight_decay"),
                                                         0.0)).init(m), master)
    moments = iter(jax.tree.leaves(master) * 2)  # mu, then nu: each in the masters' order

    def place(x):
        if x.ndim == 0:
            return t.replicated(x.shape, x.dtype)
        m = next(moments)
        assert (m.shape, m.dtype) == (x.shape, x.dtype)
        return m

    return jax.tree.map(place, state)


def _pools(t: Target, model) -> list:
    """The page pools as the engine places them (tx/sampling/paged_calls.py): kv heads split like the
    attention's, every page on every fsdp device."""
    cfg = model.config
    dtype = model.embed_tokens.embedding[...].dtype
    shape = lambda n: (n, PAGES, PAGE, cfg.num_key_value_heads, cfg.head_dim)  # noqa: E731
    return [tuple(jax.ShapeDtypeStruct(shape(len(s.layer_ids)), dtype, sharding=NamedSharding(
        t.mesh, model.layout.spec(POOL_AXES, shape(len(s.layer_ids))))) for _ in range(2)) for s in model.stacks]


def _firsts(t: Target, model) -> jax.ShapeDtypeStruct:
    """The first-token buffer as the engine places it (tx/sampling/first_tokens.py): replicated."""
    return t.replicated((t.rows + 2, model.config.hidden_size), np.float32)


def paged_prefill(t: Target):
    r, c = t.rows, 16
    arrays = {"ids_rc": np.zeros((r, c), np.int32), "pos_rc": np.zeros((r, c), np.int32),
              "valid_rc": np.zeros((r, c), bool), "adapter_r": np.zeros(r, np.int32),
              "table_rw": np.zeros((r, WIDTH), np.int32), "first_r": np.zeros(r, np.int32)}
    fn = jax.jit(prefill_chunk, static_argnames=("impl", "kv_block"), donate_argnames=("pools", "firsts_nd"))
    model = t.lora_model
    return fn, (abstract(model), _pools(t, model), _firsts(t, model), PrefillInputs(**t.batch(arrays)), None), dict(
        impl=PAGED_IMPL[t.platform], kv_block=32)


def paged_decode(t: Target):
    s = t.rows
    ints = ("token_s", "pos_s", "gen_s", "adapter_s", "top_k_s", "max_tokens_s", "copy_src_s", "copy_dst_s",
            "first_s")
    arrays = {k: np.zeros(s, np.int32) for k in ints} | {
        "active_s": np.zeros(s, bool), "seed_s": np.zeros(s, np.uint32),
        **{k: np.zeros(s, np.float32) for k in ("temperature_s", "top_p_s", "min_p_s", "penalty_s")},
        "stop_sx": np.zeros((s, 8), np.int32), "table_sw": np.zeros((s, WIDTH), np.int32)}
    fn = jax.jit(decode_steps, static_argnames=("steps", "topk", "impl", "kv_block"), donate_argnames=("pools",))
    model = t.lora_model
    inp = SlotInputs(**({"presence_sv": None} | t.batch(arrays)))
    static = dict(steps=2, topk=2, impl=PAGED_IMPL[t.platform], kv_block=32)
    return fn, (abstract(model), _pools(t, model), _firsts(t, model), inp, np.int32(2), None), static  # the scan


def prompt_scores(t: Target):
    b = t.rows
    arrays = {"ids_bt": np.zeros((b, 16), np.int32), "mask_bt": np.zeros((b, 16), np.int32),
              "adapter_b": np.zeros(b, np.int32), "target_ids_btm": np.zeros((b, 16, 2), np.int32),
              "temperature_b": np.zeros(b, np.float32), "seed_b": np.zeros(b, np.uint32)}
    fn = jax.jit(score_prompts, static_argnames=("chunk_size", "top_k", "alt_k"))
    return fn, (abstract(t.lora_model), PromptScoreInputs(**t.batch(arrays))), dict(chunk_size=16, top_k=2, alt_k=0)


# program: (builder, the Mosaic kernel families its tpu lowering holds, whether its attention is bfloat16)
PROGRAMS: dict[str, tuple[Callable, set[str], bool]] = {
    "lora_forward": (lora_pass("forward"), {"splash", "megablox"}, False),
    "lora_grads": (lora_pass("grads"), {"splash", "splash_bwd", "megablox"}, False),
    "lora_accumulate": (lora_pass("accumulate"), {"splash", "splash_bwd", "megablox"}, False),
    "lora_commit_grads": (lora_commit_grads, set(), False),
    "lora_optim_step": (lora_optim_step, set(), False),
    "full_grads": (full_pass("grads"), {"splash", "splash_bwd", "megablox"}, True),
    "full_commit_grads": (full_commit_grads, set(), False),
    "full_optim_step": (full_optim_step, set(), False),
    "paged_prefill": (paged_prefill, {"paged", "megablox"}, False),
    "paged_decode": (paged_decode, {"paged", "megablox"}, False),
    "prompt_scores": (prompt_scores, {"splash", "megablox"}, False),
}


def _families(module: str) -> set[str]:
    """The Mosaic kernel families in a lowered module, by kernel name (megablox's kernels are all named
    "kernel")."""
    def family(name: str) -> str:
        if name.startswith("splash"):
            return "splash_bwd" if "_dq_" in name or "_dkv_" in name else "splash"
        return "paged" if name == "ragged_paged_attention" else "megablox"

    return {family(n) for n in mosaic_kernels(module)}


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_program_lowers(target, program, monkeypatch):
    build, tpu_kernels, bf16_attention = PROGRAMS[program]
    fn, args, *static = build(target)
    cudnn_calls = Counter()

    def cudnn_stand_in(q, k, v, lengths_b, scale):  # records that "auto" picked cuDNN (tracing it needs a GPU)
        cudnn_calls[q.dtype.name] += 1
        return q

    monkeypatch.setattr(attn, "_cudnn_attention", cudnn_stand_in)
    module = lower(fn, target.platform, *args, **(static[0] if static else {}))
    if target.platform == "tpu":
        assert _families(module) == tpu_kernels
    else:
        assert MOSAIC not in custom_calls(module)
        assert bool(cudnn_calls) == bf16_attention, cudnn_calls
    assert_no_host_callbacks(module)
