"""DeepSeek-V3 (`DeepseekV3ForCausalLM`: multi-head latent attention, shared + routed experts with grouped sigmoid
routing and its selection bias, dense first layers) against transformers' own model on checkpoints transformers
wrote (`save_pretrained`): log-probs (1e-4, float32) with and without the query bottleneck, LoRA on every MLA
projection against PEFT (log-probs and gradients), the MLP/expert LoRA against transformers with the deltas
merged, training through the backend, greedy paged sampling (the absorbed latent cache) == `generate`, the
latent cache's bytes per token, and 8 sharded devices == one."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

import tx
from tests.helpers import (GREEDY_PROMPT, assert_logprobs_match_hf, hf_logprobs, make_batch, peft_model_of,
                           random_batch, train_and_check_two_adapters)
from tests.sampling.test_sample import SP, sample_batch
from tx import types
from tx.models.adapters import get_adapter_weights, hf_module_names, lora_modules, set_adapter_weights
from tx.models.config import LoraSlots, ModelConfig
from tx.models.layers.lora import LoraB
from tx.models.loading import load_model

TOL = 1e-4
MLA_TARGETS = ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "lm_head"]


# DeepSeek-V3's own YaRN parameters, with a 64-token original context so that the scaling matters in the tests
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _deepseek(root, q_lora_rank: int | None):
    """A random DeepSeek-V3-shaped model written by transformers: 4 heads of 16 + 8 (RoPE, interleaved) query/key
    dims and 12 value dims over a 16-dim latent, one dense layer then two MoE layers of 8 experts in 4 groups
    (top-2 groups, 3 experts per token, one shared expert), a random selection bias. Without the query
    bottleneck, DeepSeek-V3's YaRN RoPE (its softmax temperature included)."""
    torch.manual_seed(0 if q_lora_rank else 1)
    rope = {} if q_lora_rank else {"rope_parameters": YARN}
    config = DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, v_head_dim=12,
        qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
        max_position_embeddings=1024, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0, **rope)
    model = DeepseekV3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    out = root / f"deepseek-q{q_lora_rank}"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {"q_lora": _deepseek(root, 24), "q_proj": _deepseek(root, None)}


@pytest.mark.parametrize("name", ["q_lora", "q_proj"])
def test_logprobs_match_transformers(deepseek_dirs, name):
    model_dir = deepseek_dirs[name]
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.moe_router == "sigmoid_grouped"
    assert cfg.mla.q_lora_rank == (24 if name == "q_lora" else None) and cfg.head_dim == 8
    assert (cfg.yarn_rope is None) == (name == "q_lora")
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True] and cfg.n_shared_experts == 1
    model = load_model(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert hf.model.layers[1].mlp.gate.e_score_correction_bias.abs().max() > 0.01  # the bias is loaded and used
    assert_logprobs_match_hf(model, hf, 3, [512, 40], tol=TOL)


YARN_CASES = {
    "deepseek_v3": (10000.0, 64, {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "qwen3": (1e6, 128, {"factor": 4.0, "original_max_position_embeddings": 32768}),  # Qwen3's long-context recipe
    "untruncated": (50000.0, 64, {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0, "truncate": False}),
}
# transformers' own YaRN init, run by torch's scalar (libm) kernels (ATEN_CPU_CAPABILITY=default): its SIMD powf
# is 1 ulp accurate, not correctly rounded (e.g. 1e6 ** 0.578125), and tx holds the correctly rounded power, as
# tests/models/test_rope.py shows for the default RoPE
_HF_YARN = """
import json, sys
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
out = {}
for name, (theta, dim, rope) in json.loads(sys.argv[1]).items():
    cfg = DeepseekV3Config(qk_rope_head_dim=dim, max_position_embeddings=163840,
                           rope_parameters={"rope_type": "yarn", "rope_theta": theta, **rope})
    freqs, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    out[name] = [freqs.numpy().view("uint32").tolist(), factor]
print(json.dumps(out))
"""


def test_yarn_frequencies_are_bit_identical_to_transformers():
    import os
    import subprocess
    import sys

    from tx.models.config import YarnRope
    from tx.models.layers.rope import yarn_inv_freq

    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    out = subprocess.run([sys.executable, "-c", _HF_YARN, json.dumps(YARN_CASES)], env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    want = json.loads(out.stdout.strip().splitlines()[-1])
    for name, (theta, head_dim, rope) in YARN_CASES.items():
        got, factor = yarn_inv_freq(head_dim, theta, YarnRope(**rope).key())
        np.testing.assert_array_equal(got.view(np.uint32), np.asarray(want[name][0], np.uint32), err_msg=name)
        assert factor == pytest.approx(want[name][1], rel=1e-12), name
    assert YARN_CASES["deepseek_v3"][2]["factor"] == 40.0 and factor != 1.0  # the untruncated case scales cos/sin


def test_config_maps_and_refuses(deepseek_dirs):
    hf = json.loads((deepseek_dirs["q_lora"] / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(hf)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.first_k_dense_replace) == (4, 2, 2.5, 1)
    assert cfg.num_experts == 8 and cfg.mla.kv_lora_rank == 16 and cfg.mla.rope_interleave
    with pytest.raises(ValueError, match="quantized checkpoints are not supported .*'fp8'"):
        ModelConfig.from_hf_dict({**hf, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="n_group=3 must divide num_experts=8"):
        ModelConfig.from_hf_dict({**hf, "n_group": 3})
    # keys a config.json leaves out take DeepseekV3Config's defaults (DeepSeek-V3's own sizes)
    defaults = ModelConfig.from_hf_dict({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"})
    assert (defaults.num_experts, defaults.mla.q_lora_rank, defaults.mla.kv_lora_rank, defaults.first_k_dense_replace,
            defaults.num_hidden_layers) == (256, 1536, 512, 3, 61)


def _module_names(model) -> dict[str, tuple[int, int, int | None]]:
    """{HF module name: (in, out, experts or None)} of every LoRA-carrying module of the tx model."""
    out = {}
    for path, module, layer_ids in lora_modules(model):
        shape = module.kernel.shape if hasattr(module, "kernel") and module.kernel is not None else None
        for name in hf_module_names(path, layer_ids):
            if path[0] == "lm_head":
                out[name] = (model.config.hidden_size, model.config.vocab_size, None)
            else:
                experts = shape[-3] if "experts" in path and "shared_experts" not in path else None
                out[name] = (shape[-2], shape[-1], experts)
    return out


def _random_lora(model, rng, rank):
    """PEFT-layout random LoRA ({name: (A [.., r, in], B [.., out, r])}) for every module of the tx model."""
    out = {}
    for name, (i, o, experts) in _module_names(model).items():
        lead = () if experts is None else (experts,)
        out[name] = (rng.standard_normal((*lead, rank, i)).astype(np.float32) * 0.2,
                     rng.standard_normal((*lead, o, rank)).astype(np.float32) * 0.2)
    return out


def _reference(model_dir, weights, rank, alpha):
    """transformers' float32 model with `weights`: PEFT on the attention projections and the LM head, the MLP,
    shared-expert and expert deltas merged into transformers' weights (PEFT retargets the experts' fused
    tensors on transformers 5)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    scale = alpha / rank
    with torch.no_grad():
        for name, (a, b) in weights.items():
            if ".mlp." not in name:
                continue
            delta = torch.tensor(scale * np.einsum("...or,...ri->...oi", b, a))
            parent, proj = name.rsplit(".", 1)
            module = base.get_submodule(parent)
            if not parent.endswith(".experts"):
                getattr(module, proj).weight += delta
            elif proj == "down_proj":
                module.down_proj += delta
            else:
                ff = module.down_proj.shape[-1]
                module.gate_up_proj[:, :ff] += delta if proj == "gate_proj" else 0
                module.gate_up_proj[:, ff:] += delta if proj == "up_proj" else 0
    return peft_model_of(model_dir, {k: v for k, v in weights.items() if ".mlp." not in k}, rank, alpha, base=base)


@pytest.mark.parametrize("name", ["q_lora", "q_proj"])
def test_lora_on_every_module_matches_references_row_by_row(deepseek_dirs, name):
    """Two adapters with random LoRA on every MLA projection, the dense MLP, the shared and routed experts and
    the LM head, mixed with the base model in one batch: each row equals its reference."""
    model_dir = deepseek_dirs[name]
    model = load_model(model_dir, LoraSlots(max_lora_adapters=4, max_lora_rank=8))
    rng = np.random.default_rng(7)
    refs = {0: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)}
    for slot, rank, alpha in [(1, 8, 16), (3, 4, 12)]:
        weights = _random_lora(model, rng, rank)
        assert {k.rsplit(".", 1)[-1] for k in weights} >= set(MLA_TARGETS) - {"q_proj", "q_a_proj", "q_b_proj"}
        set_adapter_weights(model, slot, weights, alpha=alpha, rank=rank)
        refs[slot] = _reference(model_dir, weights, rank, alpha)
    adapters = np.array([3, 1, 0])
    ids, mask, targets = random_batch(8, [70, 70, 30], 512)
    hidden = model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(adapters))
    got = np.asarray(model.target_logprobs(hidden, jnp.asarray(targets), jnp.asarray(adapters)))
    for row, slot in enumerate(adapters):
        want = hf_logprobs(refs[slot], ids[row:row + 1], mask[row:row + 1], targets[row:row + 1])[0]
        valid = mask[row].astype(bool)
        assert np.abs(got[row] - want)[valid].max() <= TOL, f"row {row} (adapter {slot})"


def test_mla_lora_gradients_match_peft(deepseek_dirs):
    """d(sum of log-probs) / d(LoRA B) of every attention projection and the LM head equals PEFT's autograd
    (the gradient runs back through the MoE layers' routing and shared experts to layer 0)."""
    model_dir = deepseek_dirs["q_lora"]
    rank, alpha = 4, 8
    model = load_model(model_dir, LoraSlots(max_lora_adapters=2, max_lora_rank=rank))
    rng = np.random.default_rng(3)
    weights = {k: v for k, v in _random_lora(model, rng, rank).items() if ".mlp." not in k}
    set_adapter_weights(model, 1, weights, alpha=alpha, rank=rank)
    peft = _reference(model_dir, weights, rank, alpha)
    ids, mask, targets = random_batch(4, [40, 25], 512)
    valid = torch.tensor(mask, dtype=torch.float32)
    logits = peft(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets, dtype=torch.long)[..., None])[..., 0]
    (lp * valid).sum().backward()
    want = {name.removeprefix("base_model.model."): m.lora_B["default"].weight.grad.numpy()
            for name, m in peft.named_modules() if hasattr(m, "lora_B") and "default" in m.lora_B}

    from flax import nnx

    graphdef, lora_state, rest = nnx.split(model, LoraB, ...)
    adapters = jnp.ones(2, jnp.int32)

    def total(lora_state):
        m = nnx.merge(graphdef, lora_state, rest)
        hidden = m(jnp.asarray(ids), jnp.asarray(mask), adapters)
        return jnp.sum(m.target_logprobs(hidden, jnp.asarray(targets), adapters) * jnp.asarray(mask))

    grads = jax.grad(total)(lora_state)
    merged = nnx.merge(graphdef, grads, rest)
    got = {}
    for path, module, layer_ids in lora_modules(merged):
        g = np.asarray(module.lora_b.get_value())  # [..., A, R, out]
        for i, hf_name in enumerate(hf_module_names(path, layer_ids)):
            if hf_name in want:
                got[hf_name] = (g[i] if layer_ids is not None else g)[1, :rank].T
    assert got.keys() == want.keys() and len(want) == 3 * 5 + 1
    for k in want:
        scale = np.abs(want[k]).max()
        assert np.abs(got[k] - want[k]).max() <= 1e-4 * max(1.0, scale), k


def test_backend_trains_and_greedy_paged_sampling_matches_generate(deepseek_dirs):
    """Two adapters trained in one backend; each one's forward equals its reference; greedy sampling through
    the paged engine (latent cache, kv_b absorbed into queries and outputs, with the adapter's LoRA) equals
    transformers' generate; the pool holds (kv_lora_rank + qk_rope_head_dim) values per token and layer; on a
    2x2x2 mesh (heads over tp, the latent pool whole on every device, experts over ep) the same adapters sample
    the same tokens with the same log-probs."""
    model_dir = str(deepseek_dirs["q_lora"])
    backend = tx.JaxBackend(model_dir, tx.JaxBackendConfig(max_lora_adapters=3, max_lora_rank=8, max_seq_len=96))
    samples = train_and_check_two_adapters(backend, model_dir, _reference, TOL)
    assert any(".kv_b_proj" in k for k in get_adapter_weights(backend.model, backend.models["a"].adapter_index, 8))
    sharded = tx.JaxBackend(model_dir, tx.JaxBackendConfig(
        max_lora_adapters=3, max_lora_rank=8, max_seq_len=96, fully_sharded_data_parallel_size=2,
        expert_parallel_size=2, tensor_parallel_size=2))
    assert sharded.model.stacks[1].layer.self_attn.kv_b_proj.kernel.get_value().sharding.spec[-1] == "tp"
    for model_id in ("a", "b"):
        meta = backend.models[model_id]
        sharded.create_model(model_id, meta.lora_config)
        weights = get_adapter_weights(backend.model, meta.adapter_index, meta.lora_config.rank)
        set_adapter_weights(sharded.model, sharded.models[model_id].adapter_index, weights,
                            alpha=meta.lora_config.alpha, rank=meta.lora_config.rank)
        out = sharded.sample(sample_batch([("s", model_id, [(GREEDY_PROMPT, SP(max_tokens=12, temperature=0.0))], False,
                                            0)]))["s"].sequences[0]
        assert out.tokens == samples[model_id][0], model_id
        np.testing.assert_allclose(np.asarray(out.logprobs), samples[model_id][1], atol=1e-4)
    # the latent cache: one pool per stack, (16 + 8) values per token and layer
    model = backend.model
    assert model.kv_bytes_per_token() == (16 + 8) * 3 * 4
    pools = backend.sampler.paged.device.pools
    per_token = sum(pool.nbytes // (pool.shape[1] * pool.shape[2]) for stack in pools for pool in stack)
    assert per_token == model.kv_bytes_per_token() and all(len(stack) == 1 for stack in pools)


def test_sharded_over_8_devices_equals_one_device(deepseek_dirs):
    """The (fsdp, ep, tp) rules hold for latent attention, shared experts and grouped routing: with two adapters,
    log-probs on a 2x2x2 mesh of 8 CPU devices equal one device's (the other mesh shapes split one axis each,
    which this one splits at once; tests/models/test_sharding.py runs them for Qwen3)."""
    from tests.models.test_sharding import _run
    from tx.models.sharding import make_mesh

    _, want = _run(str(deepseek_dirs["q_lora"]), make_mesh(devices=jax.devices()[:1]))
    _, got = _run(str(deepseek_dirs["q_lora"]), make_mesh(2, 2, 2))
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_tx_written_deepseek_checkpoint_matches_transformers(tmp_path, q_lora_rank=32):
    """`tx.models.tiny` with family="deepseek_v3" (what the benchmarks' --family deepseek_v3 writes) is a checkpoint
    transformers loads as its own DeepSeek-V3 (per-expert tensors, as DeepSeek's releases): tx's log-probs equal
    its (1e-4)."""
    from tx.models.tiny import TinySpec, write_tiny_model

    spec = TinySpec(family="deepseek_v3", q_lora_rank=q_lora_rank, num_layers=3, num_experts=8, n_group=4,
                    topk_group=2, num_experts_per_tok=3, init_std=0.2, seed=5)
    model_dir = write_tiny_model(tmp_path / "deepseek", spec)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert isinstance(hf, DeepseekV3ForCausalLM) and hf.config.q_lora_rank == (q_lora_rank or None)
    assert hf.model.layers[2].mlp.gate.e_score_correction_bias.abs().max() > 0.01
    model = load_model(model_dir)
    assert_logprobs_match_hf(model, hf, 6, [200, 64], tol=TOL)
    with pytest.raises(ValueError, match="always MoE"):
        TinySpec(family="deepseek_v3", moe=True)


def test_full_mode_steps_match_torch_adamw_and_the_export_loads_in_transformers(deepseek_dirs, tmp_path):
    """Full fine-tuning of every DeepSeek-V3 weight (MLA projections and norms, router, shared and routed
    experts): the gradient sums and the weights after one AdamW step equal transformers + torch.optim.AdamW (1e-5
    of each tensor's scale); the selection bias stays as loaded (transformers keeps it a buffer); the exported
    HF directory loads in transformers and gives tx's log-probs (1e-4)."""
    from tests.backends.test_full import ADAM, as_hf, assert_close, ce, new_backend, torch_sum_loss, weighted_datums, \
        weights_of
    from tx.checkpoints.full import export_hf_model

    model_dir = str(deepseek_dirs["q_lora"])
    datums = weighted_datums(0, [11, 7, 5])
    backend = new_backend(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = dict(hf.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]),
                            eps=ADAM["eps"], weight_decay=ADAM["weight_decay"])
    out = backend.forward_backward(make_batch([ce("r", datums)]))["r"]
    loss = torch_sum_loss(hf, datums)
    loss.backward()
    assert out.metrics["loss:sum"] == pytest.approx(loss.item(), rel=1e-5)
    assert_close(as_hf(backend.grad_sum_of("m"), backend), {k: v.grad.numpy() for k, v in params.items()}, 1e-5,
                 "gradient")
    torch.nn.utils.clip_grad_norm_(params.values(), ADAM["grad_clip_norm"])
    opt.step()
    backend.optim_step("m", types.OptimStepInput(adam_params=types.AdamParams(**ADAM)))
    assert_close(as_hf(weights_of(backend), backend), {k: v.detach().numpy() for k, v in params.items()}, 1e-5,
                 "weights after 1 step")
    export_hf_model(tmp_path / "export", backend.model, model_dir, weights=backend.master_weights("m"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    np.testing.assert_array_equal(exported.model.layers[1].mlp.gate.e_score_correction_bias.numpy(),
                                  hf.model.layers[1].mlp.gate.e_score_correction_bias.numpy())
    fwd = backend.forward(make_batch([ce("f", datums)]))["f"]
    for datum, output in zip(datums, fwd.loss_fn_outputs):
        ids = np.array([datum["input_ids"]])
        want = hf_logprobs(exported, ids, np.ones_like(ids), np.array([datum["targets"]]))[0]
        assert np.abs(output["logprobs"].to_numpy() - want).max() <= TOL
