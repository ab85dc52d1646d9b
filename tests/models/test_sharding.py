"""Sharded over (fsdp, ep, tp) on 8 CPU devices equals one device, dense and MoE, with LoRA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.helpers import random_batch
from tests.models.jit_logprobs import logprobs
from tx.models.adapters import init_adapter, lora_modules
from tx.models.config import LoraSlots
from tx.models.loading import load_model
from tx.models.sharding import batch_spec, make_mesh, param_spec

SLOTS = LoraSlots(max_lora_adapters=3, max_lora_rank=4)
MESHES = [(8, 1, 1), (2, 2, 2), (1, 1, 8), (1, 8, 1)]


def _with_adapters(model):
    """Two adapters with non-zero B, so LoRA contributes everywhere."""
    for slot in (1, 2):
        init_adapter(model, slot, rank=4 - slot, alpha=8, seed=slot)
    rng = np.random.default_rng(0)
    for _, module, _ in lora_modules(model):
        b = module.lora_b.get_value()
        module.lora_b.set_value(jnp.asarray(rng.standard_normal(b.shape) * 0.1, jnp.float32).at[..., 0, :, :].set(0))
    return model


def _run(model_dir, mesh):
    model = _with_adapters(load_model(model_dir, SLOTS, mesh))
    ids, mask, targets = random_batch(11, [9, 9, 4, 7, 9, 2, 5, 8], 512)
    adapters = np.array([0, 1, 2, 1, 2, 0, 1, 2])
    put = lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, batch_spec(x.ndim)))  # noqa: E731
    out = logprobs(model, put(ids), put(mask), put(adapters), put(targets))
    return model, np.asarray(out) * mask


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_sharded_equals_single_device(tiny_dirs, name):
    _, want = _run(tiny_dirs[name], make_mesh(devices=jax.devices()[:1]))
    for shape in MESHES:
        model, got = _run(tiny_dirs[name], make_mesh(*shape))
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"mesh {shape}")
        if shape == (2, 2, 2):
            q = model.stacks[0].layer.self_attn.q_proj.kernel.get_value()
            assert q.sharding.spec == P(None, "fsdp", "tp")
            assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (2, 32, 32)
            if name == "moe":
                gate = model.stacks[0].layer.mlp.experts.gate_proj.lora_a.get_value()
                assert gate.sharding.spec == P(None, "ep", None, "fsdp")  # trailing None dropped


def test_heads_fallback_and_non_divisible_dims(tiny_dirs):
    from tx.models.config import ModelConfig

    cfg = ModelConfig.from_dir(tiny_dirs["dense"])  # 4 query heads, 2 kv heads
    mesh = make_mesh(1, 1, 8)
    path = ("stacks", "0", "layer", "self_attn", "q_proj", "kernel")
    # kv heads (2) do not divide tp=8: attention is replicated over tp
    assert param_spec(path, (2, 64, 64), mesh, cfg) == P(None, "fsdp", None)
    assert param_spec(path, (2, 64, 64), make_mesh(1, 1, 2, jax.devices()[:2]), cfg) == P(None, "fsdp", "tp")
    assert param_spec(path, (2, 64, 64), make_mesh(1, 1, 2, jax.devices()[:2]), cfg, shard_attention_heads=False) == P(None, "fsdp", None)
    # an MLP width that does not divide is replicated along that axis
    up = ("stacks", "0", "layer", "mlp", "up_proj", "kernel")
    assert param_spec(up, (2, 64, 12), mesh, cfg) == P(None, "fsdp", None)
    with pytest.raises(ValueError, match="devices"):
        make_mesh(2, 2, 1)
