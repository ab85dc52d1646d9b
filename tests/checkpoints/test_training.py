"""Training checkpoints: exact resume, optimizer on/off, other slot, crash safety, clear errors."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import tx
from tests.backends.test_jax_backend import CONFIG, ce_request, slot_weights, step
from tests.helpers import make_batch, random_datums
from tx import types
from tx.checkpoints import storage, training

ADAM = dict(learning_rate=1e-2, weight_decay=0.05)


def _backend(tiny_dirs, name="dense"):
    backend = tx.JaxBackend(tiny_dirs[name], CONFIG)
    backend.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=1))
    return backend


def _train(backend, model_id, steps, seed):
    for i in range(steps):
        step(backend, model_id, random_datums(seed + i, [10, 7]), **ADAM)


def test_resume_is_bit_identical_and_optimizer_is_optional(tiny_dirs, tmp_path):
    run = _backend(tiny_dirs)
    _train(run, "a", 3, seed=0)
    run.save_checkpoint(tmp_path / "ckpt", "a")
    _train(run, "a", 3, seed=100)
    uninterrupted = slot_weights(run, "a")

    # a fresh backend: the model lives in another slot (slot 2), max_lora_rank is larger
    other = tx.JaxBackend(tiny_dirs["dense"], CONFIG.model_copy(update={"max_lora_rank": 8}))
    other.create_model("filler", types.LoraConfig(rank=2))
    other.create_model("b", types.LoraConfig(rank=4, alpha=8, seed=99))
    assert other.models["b"].adapter_index == 2
    other.load_checkpoint(tmp_path / "ckpt", "b")
    assert other.models["b"].optim_steps == 3 and other.models["b"].lora_config.seed == 1
    _train(other, "b", 3, seed=100)
    resumed = slot_weights(other, "b")
    for k, v in uninterrupted.items():
        r = resumed[k]
        if k.endswith("lora_a"):
            r, v = r[..., :4], v[..., :4]  # max_lora_rank differs; compare the live columns
            assert not np.any(resumed[k][..., 4:])
        elif k.endswith("lora_b"):
            r, v = r[..., :4, :], v[..., :4, :]
        assert np.array_equal(r, v), k

    # without the optimizer: same weights, fresh moments and step count
    fresh = _backend(tiny_dirs)
    fresh.load_checkpoint(tmp_path / "ckpt", "a", load_optimizer=False)
    saved = tx.JaxBackend(tiny_dirs["dense"], CONFIG)
    saved.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=1))
    saved.load_checkpoint(tmp_path / "ckpt", "a")
    for k, v in slot_weights(saved, "a").items():
        assert np.array_equal(slot_weights(fresh, "a")[k], v)
    counts = [int(x) for x in jax.tree.leaves(fresh.opt_state_of("a")) if np.ndim(x) == 0]
    assert counts == [0]
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(fresh.opt_state_of("a")))
    assert any(np.any(np.asarray(x)) for x in jax.tree.leaves(saved.opt_state_of("a")))


def test_crash_mid_save_keeps_the_previous_checkpoint(tiny_dirs, tmp_path, monkeypatch):
    backend = _backend(tiny_dirs)
    _train(backend, "a", 1, seed=0)
    backend.save_checkpoint(tmp_path / "ckpt", "a")
    good = slot_weights(backend, "a")
    _train(backend, "a", 2, seed=10)

    real_save = ocp.StandardCheckpointer.save

    def save_then_die(self, *args, **kwargs):
        real_save(self, *args, **kwargs)  # the array files are written...
        self.wait_until_finished()
        raise KeyboardInterrupt("injected crash before metadata and pointer")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        backend.save_checkpoint(tmp_path / "ckpt", "a")
    monkeypatch.undo()
    assert len([p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("v-")]) == 1
    restored = _backend(tiny_dirs)
    restored.load_checkpoint(tmp_path / "ckpt", "a")
    for k, v in good.items():
        assert np.array_equal(slot_weights(restored, "a")[k], v)


def test_errors_change_nothing(tiny_dirs, tmp_path):
    backend = _backend(tiny_dirs)
    _train(backend, "a", 1, seed=0)
    backend.save_checkpoint(tmp_path / "ckpt", "a")
    backend.create_model("r8", types.LoraConfig(rank=8))
    before = slot_weights(backend, "r8")
    with pytest.raises(training.CheckpointError, match="has LoRA rank 4, model 'r8' has rank 8"):
        backend.load_checkpoint(tmp_path / "ckpt", "r8")
    with pytest.raises(storage.CheckpointNotFound, match="no checkpoint at"):
        backend.load_checkpoint(tmp_path / "missing", "r8")
    with pytest.raises(KeyError, match="unknown model_id 'ghost'"):
        backend.load_checkpoint(tmp_path / "ckpt", "ghost")
    with pytest.raises(KeyError, match="unknown model_id 'ghost'"):
        backend.save_checkpoint(tmp_path / "x", "ghost")
    moe = _backend(tiny_dirs, "moe")
    with pytest.raises(training.CheckpointError, match="was saved for base model"):
        moe.load_checkpoint(tmp_path / "ckpt", "a")
    # corrupt: damage the array files of the current version
    version = (tmp_path / "ckpt" / "LATEST").read_text().strip()
    for f in (tmp_path / "ckpt" / version / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "metadata" not in f.name:
            f.write_bytes(b"\0garbage" * 3)
    backend.create_model("c", types.LoraConfig(rank=4))
    before_c = slot_weights(backend, "c")
    with pytest.raises(training.CheckpointError, match="could not be read"):
        backend.load_checkpoint(tmp_path / "ckpt", "c")
    (tmp_path / "ckpt" / version / "metadata.json").write_text("{}")
    with pytest.raises(training.CheckpointError, match="has format None"):
        backend.load_checkpoint(tmp_path / "ckpt", "c")
    for model_id, snapshot in (("r8", before), ("c", before_c)):
        for k, v in slot_weights(backend, model_id).items():
            assert np.array_equal(snapshot[k], v)
    out = backend.forward(make_batch([ce_request("r", "c", random_datums(3, [5]))]))
    assert isinstance(out["r"], types.ForwardBackwardOutput)


def test_checkpoints_from_before_the_value_head_load_with_a_zero_head(tiny_dirs, tmp_path, monkeypatch):
    run = _backend(tiny_dirs)
    _train(run, "a", 2, seed=0)
    flatten = training._flatten
    with monkeypatch.context() as m:  # write the checkpoint as tx did before value heads existed
        m.setattr(training, "_flatten", lambda tree: {k: v for k, v in flatten(tree).items() if "value_head" not in k})
        run.save_checkpoint(tmp_path / "old", "a")
    assert not any("value_head" in k for g in training.read_metadata(tmp_path / "old")["shapes"].values() for k in g)
    other = _backend(tiny_dirs)
    head = other.model.lm_head.value_head
    head.set_value(head[...].at[1].set(1.0))  # garbage in the slot: loading must zero it
    other.load_checkpoint(tmp_path / "old", "a")
    for k, v in slot_weights(run, "a").items():
        assert np.array_equal(slot_weights(other, "a")[k], v), k
    assert not np.any(np.asarray(head[...][1]))
