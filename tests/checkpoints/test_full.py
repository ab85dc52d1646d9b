"""Full-training checkpoints: the orbax training state (bit-identical round trip, across meshes, crash-safe)
and the HF export (loads in transformers with equal log-probs, and in tx's own loader bit for bit)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P
from transformers import AutoModelForCausalLM

from tests.helpers import hf_logprobs, random_batch
from tests.models.jit_logprobs import logprobs
from tx.checkpoints import full
from tx.checkpoints.training import CheckpointError, base_signature
from tx.models.config import LoraSlots
from tx.models.loading import load_model
from tx.models.safetensors_io import SafetensorsDir
from tx.models.sharding import make_mesh, to_host

SLOTS = LoraSlots(max_lora_adapters=1, max_lora_rank=1)
OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, b1=0.8, weight_decay=0.1))


def _one_device():
    return make_mesh(devices=jax.devices()[:1])


@jax.jit
def _adam_step(params, opt_state, s):
    grads = jax.tree.map(lambda x: jnp.sin(x * 7.0 + s) * 0.1, params)  # deterministic, keeps the sharding
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _trained(model_dir, mesh, steps=2):
    """Base weights and AdamW state after `steps` updates (non-zero moments, a step count)."""
    params = nnx.state(load_model(model_dir, SLOTS, mesh), full.BASE_WEIGHTS)
    opt_state = OPT.init(params)
    for s in range(steps):
        params, opt_state = _adam_step(params, opt_state, jnp.float32(s))
    return params, opt_state


def _targets(model_dir, mesh):
    """Fresh state on `mesh`: the restore targets (their shardings say where the arrays go)."""
    params = nnx.state(load_model(model_dir, SLOTS, mesh), full.BASE_WEIGHTS)
    return params, OPT.init(params)


def _assert_equal(got, want):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert jax.tree.structure(got) == jax.tree.structure(want) and len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        assert g.dtype == w.dtype and np.array_equal(to_host(g), to_host(w))


def test_round_trip_is_bit_identical(tiny_dirs, tmp_path):
    params, opt_state = _trained(tiny_dirs["dense"], _one_device())
    base = base_signature(load_model(tiny_dirs["dense"], SLOTS).config)
    full.save_full_checkpoint(tmp_path / "ckpt", params, opt_state, 2, {"base_model": "tiny", "base": base})
    target_params, target_opt = _targets(tiny_dirs["dense"], _one_device())
    got = full.load_full_checkpoint(tmp_path / "ckpt", target_params, target_opt, expected_base=base)
    _assert_equal(got.params, params)
    _assert_equal(got.opt_state, opt_state)
    assert got.step == 2 and got.metadata["base_model"] == "tiny" and got.metadata["tx_version"]
    assert int(got.opt_state[1][0].count) == 2  # AdamW's own count came back too

    weights_only = full.load_full_checkpoint(tmp_path / "ckpt", target_params)
    assert weights_only.opt_state is None
    _assert_equal(weights_only.params, params)
    with pytest.raises(CheckpointError, match="was saved for base model 'tiny'"):
        full.load_full_checkpoint(tmp_path / "ckpt", target_params, expected_base={**base, "hidden_size": 1})
    moe_params, _ = _targets(tiny_dirs["moe"], _one_device())
    with pytest.raises(CheckpointError, match="does not match this model's params"):
        full.load_full_checkpoint(tmp_path / "ckpt", moe_params)
    with pytest.raises(ValueError, match=r"metadata keys \['step'\] are reserved"):
        full.save_full_checkpoint(tmp_path / "other", params, opt_state, 2, {"step": 1})
    with pytest.raises(ValueError, match="step=-1"):
        full.save_full_checkpoint(tmp_path / "other", params, opt_state, -1, {})


@pytest.mark.parametrize("direction", ["sharded_to_one", "one_to_sharded"])
def test_restore_on_another_mesh(tiny_dirs, tmp_path, direction):
    sharded, one = make_mesh(2, 2, 2), _one_device()
    src, dst = (sharded, one) if direction == "sharded_to_one" else (one, sharded)
    params, opt_state = _trained(tiny_dirs["moe"], src)
    full.save_full_checkpoint(tmp_path / "ckpt", params, opt_state, 7, {})
    target_params, target_opt = _targets(tiny_dirs["moe"], dst)
    abstract = full.abstract_state((target_params, target_opt))  # targets need no memory
    got = full.load_full_checkpoint(tmp_path / "ckpt", *abstract)
    _assert_equal(got.params, params)
    _assert_equal(got.opt_state, opt_state)
    assert got.step == 7
    for g, t in zip(jax.tree.leaves((got.params, got.opt_state)), jax.tree.leaves((target_params, target_opt))):
        assert g.sharding.is_equivalent_to(t.sharding, g.ndim)  # restored where the targets live
    q = got.params["stacks"][0]["layer"]["self_attn"]["q_proj"]["kernel"].get_value()
    mu = got.opt_state[1][0].mu["stacks"][0]["layer"]["mlp"]["experts"]["gate_proj"]["kernel"].get_value()
    if dst is sharded:
        assert q.sharding.spec == P(None, "fsdp", "tp") and len(q.addressable_shards) == 8
        assert mu.sharding.spec == P(None, "ep", "fsdp", "tp")
    else:
        assert len(q.sharding.device_set) == 1 and len(mu.sharding.device_set) == 1


def test_crash_mid_save_keeps_the_previous_version(tiny_dirs, tmp_path, monkeypatch):
    mesh = _one_device()
    params, opt_state = _trained(tiny_dirs["dense"], mesh, steps=1)
    full.save_full_checkpoint(tmp_path / "ckpt", params, opt_state, 1, {})
    later_params, later_opt = _trained(tiny_dirs["dense"], mesh, steps=3)
    real_save = ocp.StandardCheckpointer.save

    def save_then_die(self, directory, *args, **kwargs):
        real_save(self, directory, *args, **kwargs)
        self.wait_until_finished()
        if directory.name == "opt_state":  # weights written, moments written, no metadata or pointer yet
            raise KeyboardInterrupt("injected crash")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        full.save_full_checkpoint(tmp_path / "ckpt", later_params, later_opt, 3, {})
    monkeypatch.undo()
    assert len([p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("v-")]) == 1
    got = full.load_full_checkpoint(tmp_path / "ckpt", *_targets(tiny_dirs["dense"], mesh))
    assert got.step == 1
    _assert_equal(got.params, params)
    _assert_equal(got.opt_state, opt_state)


def _perturbed(model_dir, mesh):
    model = load_model(model_dir, SLOTS, mesh)
    state = nnx.state(model, full.BASE_WEIGHTS)
    nnx.update(model, jax.tree.map(lambda x: x + 0.05 * jnp.sin(x * 13.0 + 1.0), state))
    return model


# (tiny model, mesh, small chunks: gathers in row ranges and one block per layer of experts, directory or tar)
EXPORTS = [("dense_tied_mha", None, False, False), ("moe_no_norm_mixed", (2, 2, 2), True, True)]


@pytest.mark.parametrize("name,mesh,small_chunks,as_dir", EXPORTS)
def test_export_loads_in_transformers_and_tx(tiny_dirs, tmp_path, name, mesh, small_chunks, as_dir):
    base_dir = tiny_dirs[name]
    model = _perturbed(base_dir, make_mesh(*mesh) if mesh else _one_device())
    out = tmp_path / "sampler_weights" / "s1"
    kwargs = {"max_shard_bytes": 100_000, **({"chunk_bytes": 64 * 1024} if small_chunks else {})}
    full.save_sampler_model(out, model, base_dir, {"model_id": "m"}, as_dir=as_dir, **kwargs)
    assert out.is_dir() == as_dir
    with full.open_sampler_model(out) as (hf_dir, meta):
        assert meta["model_id"] == "m" and meta["format"] == full.SAMPLER_FORMAT
        index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
        files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
        assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
        assert json.loads((hf_dir / "config.json").read_text())["dtype"] == "float32"
        assert (hf_dir / "tokenizer.json").exists() and (hf_dir / "generation_config.json").exists()
        exported, base = SafetensorsDir(hf_dir), SafetensorsDir(base_dir)
        names = sorted(base.keys())
        assert sorted(exported.keys()) == names  # names and shapes of the released layout
        assert all(exported.shape(k) == base.shape(k) for k in names)

        hf, info = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, output_loading_info=True)
        assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
        reloaded = load_model(hf_dir, SLOTS)
    for (path, got), (_, want) in zip(nnx.to_flat_state(nnx.state(reloaded, full.BASE_WEIGHTS)),
                                      nnx.to_flat_state(nnx.state(model, full.BASE_WEIGHTS))):
        assert np.array_equal(to_host(got.get_value()), to_host(want.get_value())), path
    ids, mask, targets = random_batch(0, [13, 7], reloaded.config.vocab_size)
    got = np.asarray(logprobs(reloaded, ids, mask, jnp.zeros(2, jnp.int32), targets))
    want = hf_logprobs(hf, ids, mask, targets)
    assert np.abs(got - want)[mask.astype(bool)].max() <= 1e-4
    unchanged = load_model(base_dir, SLOTS)  # the export is the perturbed model, not the base
    assert np.abs(np.asarray(logprobs(unchanged, ids, mask, jnp.zeros(2, jnp.int32), targets)) - got).max() > 1e-3


def test_export_refuses_another_base(tiny_dirs, tmp_path):
    model = load_model(tiny_dirs["dense"], SLOTS)
    with pytest.raises(ValueError, match="describes"):
        full.export_hf_model(tmp_path / "out", model, tiny_dirs["moe"])
    (tmp_path / "junk.tar").write_bytes(b"not a tar")
    with pytest.raises(CheckpointError, match="not a readable tar"), full.open_sampler_model(tmp_path / "junk.tar"):
        pass
