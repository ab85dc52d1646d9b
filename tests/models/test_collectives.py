"""The sharded train step and decode step on 8 CPU devices: the collectives of one layer in the optimized
HLO, and the per-device bytes of weights, LoRA slots and Adam state, for (fsdp, ep, tp) = (8,1,1), (2,2,2),
(1,1,8), (1,8,1). Expected values are derived below from the model's shapes and the logical-axis rules
(`tx.models.logical.DEFAULT_RULES`), not read off the output.

The model: dense Qwen3, d=128, 8 query and 8 kv heads of 16, MLP 256, vocab 512, 2 layers (one scanned
stack: one `while` loop per pass, one iteration per layer), LoRA slots A=4 at rank R=8, batch 8 x 32.

Per layer, under the rules (batch -> fsdp; embed -> fsdp; heads, kv_heads, mlp, vocab -> tp):
- ZeRO-3 over fsdp: every weight with an "embed" axis is stored split over fsdp and all-gathered once
  before its matmul (`LogicalSharding.gathered`): the 7 kernels (q, k, v, o, gate, up, down), the 5
  lora_a whose input is embed (q, k, v, gate, up) and the 2 lora_b whose output is embed (o, down): 14.
- Megatron over tp: q/k/v/gate/up are column-parallel (outputs split), o/down row-parallel (inputs split),
  so each row-parallel linear ends in a partial sum reduced over tp: its output [b, t, d] and its LoRA
  rank activation x A [b, t, R] (A's input is split too): 2 x 2 = 4 all-reduce operands in a forward.
- Backward (gradient checkpointing "layer": the forward is recomputed, so its 14 + 4 again):
  data-parallel gradient sums over fsdp of the 14 LoRA factors of the layer (7 linears x A, B); over tp,
  the rank-activation gradients dy B^T of the 5 column-parallel linears ([b, t, R], B's output is split)
  and the input gradients [b, t, d] of the column-parallel linears: at least one per block input (2:
  attention and MLP), at most one per linear (5), as XLA may add those sharing an input before reducing.
- ep: a dense model's weights have no "expert" axis, so the ep axis holds replicas: no collective over it
  (the attention kernel runs per device, its backward too, so dq, dk, dv are not summed over ep).
- Decode (one token per row, paged KV): the same 14 weight gathers and 4 tp all-reduces per layer, plus
  over fsdp the new keys and values and their page slots (4 operands): the page pool is replicated over
  fsdp, so every replica writes every row's entries. The attention then reads the pools per device (its
  rows, its kv heads: the pools are split over tp like them), so no loop of the decode program (steps,
  layers, KV blocks) gathers anything over tp.
Nothing on tp is ever all-gathered in a layer: weights stay split over tp (no full-weight gather).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from flax import nnx

from tests.models.hlo_collectives import per_layer
from tx import types
from tx.backends.config import JaxBackendConfig
from tx.backends.jax import JaxBackend
from tx.backends.steps import TRAINABLE
from tx.models.layers.lora import LoraScale
from tx.models.tiny import TinySpec, write_tiny_model

MESHES = [(8, 1, 1), (2, 2, 2), (1, 1, 8), (1, 8, 1)]
D, HEADS, HD, FF, VOCAB, LAYERS, A, R = 128, 8, 16, 256, 512, 2, 4, 8
SPEC = TinySpec(hidden_size=D, num_heads=HEADS, num_kv_heads=HEADS, head_dim=HD, intermediate_size=FF,
                vocab_size=VOCAB, num_layers=LAYERS)
F32 = 4
EXPERTS, TOP_K, MOE_FF = 8, 2, 64
MOE_SPEC = SPEC.model_copy(update={"moe": True, "num_experts": EXPERTS, "num_experts_per_tok": TOP_K,
                                   "moe_intermediate_size": MOE_FF})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("collectives") / "m", SPEC))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("collectives") / "moe", MOE_SPEC))


def _backend(model_dir: str, mesh: tuple[int, int, int], sample: bool = True) -> JaxBackend:
    fsdp, ep, tp = mesh
    config = JaxBackendConfig(fully_sharded_data_parallel_size=fsdp, expert_parallel_size=ep, tensor_parallel_size=tp,
                              max_lora_adapters=A, max_lora_rank=R, max_num_seqs=8)
    backend = JaxBackend(model_dir, config)
    backend.programs.enabled = True
    backend.create_model("m", types.LoraConfig(rank=R, seed=0))
    rng = np.random.default_rng(0)
    seqs = rng.integers(0, VOCAB, (8, 33)).tolist()
    backend.forward_backward(types.PreparedModelPassBatch(
        all_input_ids=[s[:-1] for s in seqs], all_targets=[s[1:] for s in seqs], all_token_weights=[[1.0] * 32] * 8,
        all_sampling_logprobs=[[]] * 8, all_advantages=[[]] * 8, all_model_ids=["m"] * 8,
        all_loss_fns=["cross_entropy"] * 8, all_loss_fn_configs=[None] * 8, request_batch_slices=[("t", "m", 0, 8)]))
    if not sample:
        return backend
    backend.sample(types.PreparedSampleBatch(
        all_prompts=[seqs[0][:8]] * 8, all_sampling_params=[types.SamplingParams(max_tokens=2, stop=[])] * 8,
        all_model_ids=["m"] * 8, all_checkpoint_ids=[""] * 8, all_checkpoint_paths=[""] * 8,
        request_batch_slices=[("s", "m", 0, 8, True, 0)]))
    return backend


def _layer_bodies(hlo: str, mesh) -> list[dict]:
    """Collectives per iteration of each `while` body that has any, as plain dicts (a train step's are the
    scanned stack's forward and backward loops; the grouped-matmul and attention loops inside a layer have
    none)."""
    return [dict(c) for c in per_layer(hlo, mesh) if c]


def _expected_forward(fsdp: int, tp: int) -> dict:
    out = {}
    if fsdp > 1:
        out[("all-gather", "fsdp")] = 14
    if tp > 1:
        out[("all-reduce", "tp")] = 4
    return out


def _device_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def _expected_bytes(fsdp: int, tp: int) -> tuple[int, int]:
    """Per-device bytes of the base weights and of the LoRA factors, from the shapes: every matrix has one
    fsdp-split axis (embed) and one tp-split axis (heads/kv heads, mlp, vocab), so it is split fsdp x tp
    ways; the norms are replicated. Each LoRA factor has exactly one split axis: embed (fsdp) on one side,
    heads/mlp/vocab (tp) on the other, so A splits over fsdp and B over tp for q,k,v,gate,up,lm_head and
    the other way round for o, down; lora_scale [A] is replicated."""
    attn, mlp = 4 * D * HEADS * HD, 3 * D * FF
    matrices = LAYERS * (attn + mlp) + 2 * VOCAB * D  # + embedding and lm_head
    norms = LAYERS * (2 * D + 2 * HD) + D
    weights = F32 * (matrices // (fsdp * tp) + norms)
    in_embed = [HEADS * HD] * 3 + [FF] * 2  # A over fsdp, B over tp
    out_embed = [HEADS * HD, FF]  # A over tp, B over fsdp
    a_fsdp = LAYERS * len(in_embed) * A * D * R + A * D * R  # + lm_head A [A, d, R]
    b_tp = LAYERS * sum(in_embed) * A * R + A * R * VOCAB
    a_tp = LAYERS * sum(out_embed) * A * R
    b_fsdp = LAYERS * len(out_embed) * A * R * D
    value_head = A * D  # [A, d, 1], replicated
    lora = F32 * ((a_fsdp + b_fsdp) // fsdp + (b_tp + a_tp) // tp + value_head)
    return weights, lora


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "x".join(map(str, m)))
def test_collectives_per_layer_and_bytes(model_dir, mesh):
    fsdp, ep, tp = mesh
    backend = _backend(model_dir, mesh)
    hlo = backend.programs.lowered("forward_backward").compile().as_text()
    bodies = _layer_bodies(hlo, backend.mesh)
    if fsdp == tp == 1:  # ep replicas of a dense model: nothing moves
        assert bodies == [], bodies
        forward = backward = {}
    else:
        forward, backward = bodies  # the scanned stack's forward and backward loops
    assert forward == _expected_forward(fsdp, tp), mesh
    grads = dict(backward)
    if fsdp > 1:
        assert grads.pop(("all-gather", "fsdp")) == 14 and grads.pop(("all-reduce", "fsdp")) == 14, backward
    if tp > 1:
        assert 4 + 5 + 2 <= grads.pop(("all-reduce", "tp")) <= 4 + 5 + 5, backward
    assert grads == {}, f"unexpected collectives in the backward layer on {mesh}: {grads}"

    decode_hlo = backend.programs.lowered("sample_decode").compile().as_text()
    with_weights = [b for b in _layer_bodies(decode_hlo, backend.mesh) if b.get(("all-gather", "fsdp"), 0) >= 14
                    or b.get(("all-reduce", "tp"), 0) == 4]
    want = _expected_forward(fsdp, tp)
    if fsdp > 1:
        want[("all-gather", "fsdp")] += 4
    if want:
        assert want in with_weights, (mesh, with_weights)
    for body in _layer_bodies(hlo, backend.mesh) + with_weights:
        assert ("all-gather", "tp") not in body and ("all-gather", "ep") not in body, (mesh, body)
    for body in _layer_bodies(decode_hlo, backend.mesh):  # every loop: decode steps, layers, KV blocks
        assert ("all-gather", "tp") not in body, (mesh, body)

    weights, lora = _expected_bytes(fsdp, tp)
    _, lora_state, scales, base = nnx.split(backend.model, TRAINABLE, LoraScale, ...)
    assert _device_bytes(base) == weights, mesh
    assert _device_bytes(lora_state) == lora, mesh
    assert _device_bytes(scales) == F32 * (LAYERS * 7 + 1) * A, mesh  # [A] per linear, replicated
    # Adam: mu and nu shaped like one slot of the LoRA factors and split the same way, plus a few scalars
    # (step count, injected hyperparameters)
    opt = _device_bytes(backend.opt_state_of("m"))
    assert 2 * lora // A <= opt <= 2 * lora // A + 64, (mesh, opt)


@pytest.mark.parametrize("mesh", [(1, 8, 1), (2, 2, 2)], ids=lambda m: "x".join(map(str, m)))
def test_moe_layer_is_expert_parallel(moe_dir, mesh):
    """MoE (8 experts, top 2, width 64): each device runs its experts (over ep) on its rows (over fsdp),
    and one all-reduce of the layer's output [b, t, d] over the expert and MLP axes sums the devices' shares.
    Per layer forward: over fsdp the 14 gathers of the dense layer (attention: 4 kernels + 3 lora_a + 1
    lora_b; experts: 3 kernels + 2 lora_a (gate, up) + 1 lora_b (down), each [E, ...] gathered only over
    fsdp); over tp the attention's o_proj output and rank activation (2); over ep (+tp) the experts' sum (1).
    No expert weight is gathered over ep in the forward or the backward layer."""
    fsdp, ep, tp = mesh
    backend = _backend(moe_dir, mesh, sample=False)
    forward, backward = _layer_bodies(backend.programs.lowered("forward_backward").compile().as_text(), backend.mesh)
    want = {("all-reduce", "+".join(sorted(a for a, n in (("ep", ep), ("tp", tp)) if n > 1))): 1}
    if fsdp > 1:
        want[("all-gather", "fsdp")] = 14
    if tp > 1:
        want[("all-reduce", "tp")] = 2
    assert forward == want, (mesh, forward)
    if mesh == (1, 8, 1):  # the recomputed forward's sum, and the sum of the devices' shares of dL/d(input)
        assert backward == {("all-reduce", "ep"): 2}, backward
    for body in (forward, backward):
        assert not any(kind == "all-gather" and axes != "fsdp" for kind, axes in body), (mesh, body)
