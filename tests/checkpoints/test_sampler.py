"""Sampler checkpoints: PEFT interop both ways (dense and MoE, rank below max), sampling a checkpoint while
training goes on, the slot LRU cache, persist=False, S3 round trip, crash safety, malicious tarballs."""

import io
import tarfile

import numpy as np
import pytest
import torch
from peft import LoraConfig as PeftLoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import tx
from tests.backends.test_jax_backend import CONFIG, slot_weights, step
from tests.helpers import hf_logprobs, random_datums
from tests.ports import free_ports
from tests.sampling.test_sample import SP, sample_batch
from tx import types
from tx.checkpoints import storage

PROMPT = [5, 17, 99, 3, 42, 7, 300, 12]


def _trained(tiny_dirs, name, rank=3, steps=2):
    backend = tx.JaxBackend(tiny_dirs[name], CONFIG)
    backend.create_model("a", types.LoraConfig(rank=rank, alpha=2 * rank, seed=1))
    for i in range(steps):
        step(backend, "a", random_datums(i, [12, 9]), learning_rate=2e-2)
    return backend


def _prompt_logprobs(backend, checkpoint_path="", model_id=""):
    batch = sample_batch([("r", model_id, [(PROMPT, SP(max_tokens=1, temperature=0.0))], True, 0)])
    if checkpoint_path:
        batch.all_checkpoint_paths[0] = str(checkpoint_path)
    out = backend.sample(batch)["r"]
    assert isinstance(out, types.SampleOutput), out
    return np.array(out.prompt_logprobs[1:])


def _peft_logprobs(peft_model):
    ids = np.array([PROMPT])
    return hf_logprobs(peft_model, ids, np.ones_like(ids), np.roll(ids, -1, axis=1))[0, :-1]


@pytest.mark.parametrize("name", ["dense", "moe", "dense_tied_mha"])
def test_sampler_checkpoint_loads_in_peft_and_matches(tiny_dirs, tmp_path, name):
    backend = _trained(tiny_dirs, name)
    backend.save_sampler_checkpoint(tmp_path / "s.tar.gz", "a")
    storage.unpack_tar(tmp_path / "s.tar.gz", tmp_path / "unpacked")
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs[name], dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(tmp_path / "unpacked"))
    config = (tmp_path / "unpacked" / "adapter_config.json").read_text()
    assert '"r": 3' in config and '"q_proj"' in config and '"lm_head"' in config
    want = _peft_logprobs(peft)
    got_live = _prompt_logprobs(backend, model_id="a")
    got_ckpt = _prompt_logprobs(backend, checkpoint_path=tmp_path / "s.tar.gz")
    assert np.abs(got_live - want).max() <= 1e-4
    assert np.abs(got_ckpt - want).max() <= 1e-4
    backend.state.snapshots.clear()  # force reading the tarball from disk
    backend.slots.forget(str(tmp_path / "s.tar.gz"))
    assert np.abs(_prompt_logprobs(backend, checkpoint_path=tmp_path / "s.tar.gz") - want).max() <= 1e-4


def test_adapter_trained_with_peft_loads_into_tx(tiny_dirs, tmp_path):
    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs["dense"], dtype=torch.float32)
    cfg = PeftLoraConfig(r=6, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"],
                         rank_pattern={"down_proj": 2}, alpha_pattern={"down_proj": 8}, init_lora_weights=False)
    peft = get_peft_model(base, cfg)
    peft.save_pretrained(tmp_path / "peft")
    storage.pack_tar(tmp_path / "peft", tmp_path / "peft.tar.gz")
    backend = tx.JaxBackend(tiny_dirs["dense"], CONFIG)
    got = _prompt_logprobs(backend, checkpoint_path=tmp_path / "peft.tar.gz")
    assert np.abs(got - _peft_logprobs(peft)).max() <= 1e-4
    small = tx.JaxBackend(tiny_dirs["dense"], CONFIG.model_copy(update={"max_lora_rank": 4}))
    out = small.sample(_with_path(sample_batch([("r", "", [(PROMPT, SP(max_tokens=1))], False, 0)]), tmp_path / "peft.tar.gz"))
    assert isinstance(out["r"], types.ErrorResponse) and "adapter rank 6 exceeds max_lora_rank=4" in out["r"].error


def _with_path(batch, path):
    batch.all_checkpoint_paths[0] = str(path)
    return batch


def test_sampling_a_checkpoint_while_training_and_slot_cache(tiny_dirs, tmp_path):
    backend = _trained(tiny_dirs, "dense")
    backend.save_sampler_checkpoint(tmp_path / "old.tar.gz", "a")
    old = _prompt_logprobs(backend, checkpoint_path=tmp_path / "old.tar.gz")
    step(backend, "a", random_datums(50, [12]), learning_rate=2e-2)  # training goes on
    training_weights = slot_weights(backend, "a")
    again = _prompt_logprobs(backend, checkpoint_path=tmp_path / "old.tar.gz")
    np.testing.assert_array_equal(again, old)  # the old checkpoint, not the live adapter
    for k, v in slot_weights(backend, "a").items():
        assert np.array_equal(training_weights[k], v)  # sampling touched no training slot
    assert not np.allclose(_prompt_logprobs(backend, model_id="a"), old)
    # repeated sampling reuses the loaded slot: no reload, even from disk
    backend.state.snapshots.clear()
    backend.slots.forget(str(tmp_path / "old.tar.gz"))
    loads = backend.metrics.calls.get("load_sampler_checkpoint", 0)  # 1: re-read once the adapter stepped
    for _ in range(3):
        _prompt_logprobs(backend, checkpoint_path=tmp_path / "old.tar.gz")
    assert backend.metrics.calls["load_sampler_checkpoint"] == loads + 1
    # persist=False: a marker on disk, weights served from memory
    backend.save_sampler_checkpoint(tmp_path / "hot", "a", persist=False)
    assert (tmp_path / "hot").stat().st_size < 1000
    np.testing.assert_allclose(_prompt_logprobs(backend, checkpoint_path=tmp_path / "hot"),
                               _prompt_logprobs(backend, model_id="a"), atol=1e-6)
    other = tx.JaxBackend(tiny_dirs["dense"], CONFIG)
    out = other.sample(_with_path(sample_batch([("r", "", [(PROMPT, SP(max_tokens=1))], False, 0)]), tmp_path / "hot"))
    assert "saved with persist=False and is no longer in memory" in out["r"].error


def test_crash_mid_sampler_save_keeps_previous_file(tiny_dirs, tmp_path, monkeypatch):
    backend = _trained(tiny_dirs, "dense", steps=1)
    backend.save_sampler_checkpoint(tmp_path / "s.tar.gz", "a")
    before = (tmp_path / "s.tar.gz").read_bytes()

    def half_then_die(source_dir, out_file):
        with tarfile.open(out_file, "w:gz") as tar:
            tar.add(sorted(source_dir.iterdir())[0], arcname="partial")
        raise RuntimeError("injected crash while packing")

    monkeypatch.setattr(storage, "pack_tar", half_then_die)
    step(backend, "a", random_datums(9, [8]), learning_rate=2e-2)
    with pytest.raises(RuntimeError, match="injected"):
        backend.save_sampler_checkpoint(tmp_path / "s.tar.gz", "a")
    assert (tmp_path / "s.tar.gz").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.tar.gz"]


def _tar_with(tmp_path, name, member: tarfile.TarInfo, data: bytes = b"x"):
    path = tmp_path / name
    with tarfile.open(path, "w:gz") as tar:
        tar.addfile(member, io.BytesIO(data) if member.isfile() else None)
    return path


def test_malicious_tarballs_are_rejected(tiny_dirs, tmp_path):
    traversal = tarfile.TarInfo("../evil.txt")
    traversal.size = 1
    absolute = tarfile.TarInfo("/tmp/evil.txt")
    absolute.size = 1
    link = tarfile.TarInfo("adapter_model.safetensors")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    device = tarfile.TarInfo("dev")
    device.type = tarfile.CHRTYPE
    backend = tx.JaxBackend(tiny_dirs["dense"], CONFIG)
    for name, member, message in [("t.tgz", traversal, "unsafe path"), ("a.tgz", absolute, "unsafe path"),
                                  ("l.tgz", link, "links and special files"), ("d.tgz", device, "links and special files")]:
        path = _tar_with(tmp_path, name, member)
        with pytest.raises(ValueError, match=message):
            storage.unpack_tar(path, tmp_path / "out")
        out = backend.sample(_with_path(sample_batch([("r", "", [(PROMPT, SP(max_tokens=1))], False, 0)]), path))
        assert isinstance(out["r"], types.ErrorResponse) and message in out["r"].error
    assert not (tmp_path / "evil.txt").exists()
    (tmp_path / "junk.tar.gz").write_bytes(b"\x1f\x8b not really gzip")
    out = backend.sample(_with_path(sample_batch([("r", "", [(PROMPT, SP(max_tokens=1))], False, 0)]), tmp_path / "junk.tar.gz"))
    assert "is not a readable tar.gz" in out["r"].error
    out = backend.sample(_with_path(sample_batch([("r", "", [(PROMPT, SP(max_tokens=1))], False, 0)]), tmp_path / "none"))
    assert "no checkpoint file at" in out["r"].error


def _free_port() -> int:
    return free_ports(1)


@pytest.fixture
def s3_bucket(monkeypatch):
    """A real S3 API (moto's server) on loopback, and cloudpathlib's default S3 client pointed at it."""
    from cloudpathlib import S3Client
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="tx-test")
    S3Client(endpoint_url=endpoint).set_as_default_client()
    yield "s3://tx-test"
    server.stop()


def test_s3_round_trip(tiny_dirs, s3_bucket, tmp_path):
    backend = _trained(tiny_dirs, "dense", steps=1)
    backend.save_checkpoint(f"{s3_bucket}/runs/a/state", "a")
    backend.save_checkpoint(f"{s3_bucket}/runs/a/state", "a")  # a second version replaces the first
    backend.save_sampler_checkpoint(f"{s3_bucket}/runs/a/sampler.tar.gz", "a")
    want = slot_weights(backend, "a")
    live = _prompt_logprobs(backend, model_id="a")
    other = tx.JaxBackend(tiny_dirs["dense"], CONFIG)
    other.create_model("a", types.LoraConfig(rank=3, alpha=6))
    other.load_checkpoint(f"{s3_bucket}/runs/a/state", "a")
    for k, v in want.items():
        assert np.array_equal(slot_weights(other, "a")[k], v)
    got = _prompt_logprobs(other, checkpoint_path=f"{s3_bucket}/runs/a/sampler.tar.gz")
    np.testing.assert_allclose(got, live, atol=1e-5)
    from cloudpathlib import AnyPath

    versions = [p.name for p in AnyPath(f"{s3_bucket}/runs/a/state").iterdir()]
    assert sorted(versions)[0] == "LATEST" and len(versions) == 2
