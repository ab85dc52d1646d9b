"""Sampler checkpoints under faults (issue 12): a damaged checkpoint never half-loads a slot (9), snapshots
served from the model's own slot with every slot taken (18), deleted checkpoints evicted, failed saves
cleaned up (20)."""

import os
import time

import numpy as np
import pytest

import tx
from tests.backends.test_jax_backend import CONFIG, step
from tests.checkpoints.test_sampler import PROMPT, _prompt_logprobs
from tests.helpers import random_datums
from tests.sampling.test_sample import SP, sample_batch
from tx import types
from tx.checkpoints import storage
from tx.models.safetensors_io import SafetensorsDir, save_file

FULL = CONFIG.model_copy(update={"max_lora_adapters": 3})  # slots 1 and 2


def _sample(backend, path, max_tokens=1):
    batch = sample_batch([("r", "", [(PROMPT, SP(max_tokens=max_tokens, temperature=0.0))], True, 0)])
    batch.all_checkpoint_paths[0] = str(path)
    return backend.sample(batch)["r"]


def _slot_arrays(backend, slot):
    from tx.models.adapters import lora_modules

    return [np.take(np.asarray(getattr(m, n).get_value()), slot, axis=-1 if n == "lora_scale" else -3).copy()
            for _, m, _ in lora_modules(backend.model) for n in ("lora_a", "lora_b", "lora_scale")]


def _damage(tmp_path, good_tar, name, how):
    """Unpack `good_tar`, damage its tensors `how`, repack as `name`."""
    d = tmp_path / f"{name}-dir"
    storage.unpack_tar(good_tar, d)
    files = SafetensorsDir(d)
    tensors = {k: np.array(files.get(k)) for k in files.keys()}
    del files
    file = d / "adapter_model.safetensors"
    if how == "truncate":
        data = file.read_bytes()
        file.write_bytes(data[: len(data) - 64])
    else:
        keys = sorted(k for k in tensors if k.endswith("lora_B.weight"))
        if how == "unknown_module":  # every known module is fine; one extra name is not
            tensors["base_model.model.model.layers.0.self_attn.zz_proj.lora_A.weight"] = tensors[keys[0].replace("lora_B", "lora_A")]
            tensors["base_model.model.model.layers.0.self_attn.zz_proj.lora_B.weight"] = tensors[keys[0]]
        elif how == "bad_shape":  # a module late in the model has a B of the wrong width
            tensors[keys[-1]] = np.zeros((tensors[keys[-1]].shape[0] + 1, tensors[keys[-1]].shape[1]), np.float32)
        save_file(tensors, file)
    storage.pack_tar(d, tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize("how", ["unknown_module", "bad_shape", "truncate"])
def test_damaged_checkpoint_never_half_loads_a_slot(tiny_dirs, tmp_path, how):
    backend = tx.JaxBackend(tiny_dirs["dense"], FULL)
    backend.create_model("a", types.LoraConfig(rank=3, alpha=6, seed=1))
    step(backend, "a", random_datums(0, [12, 9]), learning_rate=2e-2)
    good = tmp_path / "good.tar.gz"
    backend.save_sampler_checkpoint(good, "a")
    backend.evict_sampler_checkpoint(good)  # served from its file from now on (a spare slot)
    want = _sample(backend, good)
    slot = backend.slots.cached(str(good))
    assert slot == 2
    before = _slot_arrays(backend, slot)
    damaged = _damage(tmp_path, good, f"{how}.tar.gz", how)
    for _ in range(2):
        out = _sample(backend, damaged)
        assert isinstance(out, types.ErrorResponse), out
        assert str(damaged) in out.error
    assert str(damaged) not in backend.slots.sampler
    for x, y in zip(before, _slot_arrays(backend, slot)):
        np.testing.assert_array_equal(x, y)  # the previous occupant is untouched
    loads = backend.metrics.calls["load_sampler_checkpoint"]
    assert _sample(backend, good) == want and backend.slots.cached(str(good)) == slot
    assert backend.metrics.calls["load_sampler_checkpoint"] == loads  # still cached, not reloaded


def test_snapshots_with_every_slot_taken(tiny_dirs, tmp_path):
    backend = tx.JaxBackend(tiny_dirs["dense"], FULL)
    for name, seed in (("a", 1), ("b", 2)):
        backend.create_model(name, types.LoraConfig(rank=3, alpha=6, seed=seed))
    assert backend.slots.take() is None  # every slot holds a training model
    step(backend, "a", random_datums(0, [12, 9]), learning_rate=2e-2)
    backend.save_sampler_checkpoint(tmp_path / "eph", "a", persist=False)
    backend.save_sampler_checkpoint(tmp_path / "p.tar.gz", "a", persist=True)
    old = _prompt_logprobs(backend, checkpoint_path=tmp_path / "eph")
    old_tokens = _sample(backend, tmp_path / "eph", max_tokens=8).sequences[0].tokens
    np.testing.assert_array_equal(old, _prompt_logprobs(backend, model_id="a"))
    other = tx.JaxBackend(tiny_dirs["dense"], FULL)  # the persisted file, loaded into a spare slot elsewhere
    np.testing.assert_allclose(old, _prompt_logprobs(other, checkpoint_path=tmp_path / "p.tar.gz"), atol=1e-5)
    # the adapter trains on: the snapshot keeps its weights (a copy taken at the step), the file is re-read
    step(backend, "a", random_datums(1, [12]), learning_rate=5e-2)
    assert not np.allclose(_prompt_logprobs(backend, model_id="a"), old)
    out = _sample(backend, tmp_path / "eph")
    assert isinstance(out, types.ErrorResponse) and "no free adapter slot" in out.error  # both slots train
    backend.delete_model("b")
    np.testing.assert_array_equal(_prompt_logprobs(backend, checkpoint_path=tmp_path / "eph"), old)
    assert _sample(backend, tmp_path / "eph", max_tokens=8).sequences[0].tokens == old_tokens
    np.testing.assert_allclose(_prompt_logprobs(backend, checkpoint_path=tmp_path / "p.tar.gz"), old, atol=1e-5)


def test_snapshots_per_model_cap_and_unload(tiny_dirs, tmp_path):
    backend = tx.JaxBackend(tiny_dirs["dense"], FULL.model_copy(update={"max_snapshots_per_model": 2}))
    backend.create_model("a", types.LoraConfig(rank=3, alpha=6, seed=1))
    for i in range(3):
        step(backend, "a", random_datums(i, [8]), learning_rate=2e-2)
        backend.save_sampler_checkpoint(tmp_path / f"s{i}", "a", persist=False)
    out = _sample(backend, tmp_path / "s0")
    assert isinstance(out, types.ErrorResponse)
    assert "no longer in memory" in out.error and "max_snapshots_per_model=2" in out.error
    assert isinstance(_sample(backend, tmp_path / "s1"), types.SampleOutput)
    backend.delete_model("a")
    out = _sample(backend, tmp_path / "s2")
    assert isinstance(out, types.ErrorResponse) and "was unloaded" in out.error


def test_deleted_sampler_checkpoint_is_evicted(tiny_dirs, tmp_path):
    backend = tx.JaxBackend(tiny_dirs["dense"], FULL)
    backend.create_model("a", types.LoraConfig(rank=3, alpha=6, seed=1))
    path = tmp_path / "p.tar.gz"
    backend.save_sampler_checkpoint(path, "a")
    assert isinstance(_sample(backend, path), types.SampleOutput)  # from a's own slot
    step(backend, "a", random_datums(0, [8]), learning_rate=2e-2)
    assert isinstance(_sample(backend, path), types.SampleOutput)  # from its file, cached in a spare slot
    assert backend.slots.cached(str(path)) == 2
    storage.remove(path)
    backend.evict_sampler_checkpoint(str(path))
    out = _sample(backend, path)
    assert isinstance(out, types.ErrorResponse) and "no checkpoint file at" in out.error
    assert backend.slots.cached(str(path)) is None


def test_engine_delete_evicts_from_backend(tmp_path):
    from tx.engine.engine import Engine, EngineConfig
    from tx.engine.store import Store

    class Recorder:
        def __init__(self):
            self.evicted: list[str] = []

        def evict_sampler_checkpoint(self, path):
            self.evicted.append(path)

    store = Store(f"sqlite:///{tmp_path / 'tx.sqlite'}")
    backend = Recorder()
    engine = Engine(backend, store, EngineConfig(checkpoint_root=str(tmp_path / "ck")), "base", None, None)
    engine.start()
    try:
        (tmp_path / "x.tar.gz").write_bytes(b"x")
        engine.delete_checkpoint_files(str(tmp_path / "x.tar.gz"))  # as the API's delete route does
        deadline = time.time() + 10
        while not backend.evicted and time.time() < deadline:
            time.sleep(0.05)
        assert backend.evicted == [str(tmp_path / "x.tar.gz")]
        assert not (tmp_path / "x.tar.gz").exists()
    finally:
        engine.stop()


def test_failed_saves_leave_nothing_and_sweep(tmp_path, monkeypatch):
    src = tmp_path / "data"
    src.write_bytes(b"payload")
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        storage.write_file_atomic(tmp_path / "out" / "s.tar.gz", src)
    assert list((tmp_path / "out").iterdir()) == []  # no .tmp-* file left
    monkeypatch.undo()
    ck = tmp_path / "ck"
    with storage.write_dir(ck, version="one") as d:
        (d / "f").write_text("1")
    real_write = storage._write_text_atomic
    monkeypatch.setattr(storage, "_write_text_atomic", lambda *a: (_ for _ in ()).throw(OSError(28, "disk full")))
    with pytest.raises(OSError):
        with storage.write_dir(ck, version="two") as d:
            (d / "f").write_text("2")
    monkeypatch.setattr(storage, "_write_text_atomic", real_write)
    assert sorted(p.name for p in ck.iterdir()) == ["LATEST", "v-one"]  # v-two did not become current
    with storage.read_dir(ck) as d:
        assert (d / "f").read_text() == "1"
    # what killed processes left: old temporary files and versions LATEST does not name; recent ones stay
    stale = [ck / "v-crashed", tmp_path / "out" / ".s.tar.gz.tmp-dead0001", ck / ".LATEST.tmp-dead0002"]
    fresh = [ck / "v-saving", tmp_path / "out" / ".s.tar.gz.tmp-live0001"]
    for p in stale + fresh:
        p.mkdir() if p.name.startswith("v-") else p.write_bytes(b"partial")
    for p in stale:
        os.utime(p, (time.time() - 7200, time.time() - 7200))
    os.utime(ck / "v-one", (time.time() - 7200, time.time() - 7200))  # old but current: kept
    removed = storage.sweep(tmp_path, older_than_s=3600)
    assert sorted(map(str, removed)) == sorted(map(str, stale))
    assert all(p.exists() for p in fresh) and (ck / "v-one").exists()
