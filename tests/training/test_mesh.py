"""A trainer's mesh (tx.training.mesh, in tx.sft's config and tx.rl's `tx:` section): fsdp_size / ep_size / tp_size
(the backend's default when left out: every device), one may be -1 / 'auto'; errors name the config's fields;
micro_batch_rows must divide over the resolved fsdp size, and per-device micro-batches (the seeds'
micro_train_batch_size_per_gpu) scale with it."""

import pytest
from pydantic import ValidationError

from tests.helpers import production_mesh_default
from tests.rl.test_trainer import example
from tx.rl.config import RLConfig
from tx.rl.trainer import RLTrainer
from tx.sft.config import SFTConfig
from tx.sft.trainer import SFTTrainer

DATA = {"dataset": "examples/data/chat_train.jsonl"}


def sft(**values) -> SFTConfig:
    return SFTConfig.model_validate({"data": DATA} | values)


def test_mesh_sizes_default_to_every_device_and_one_may_be_auto():
    with production_mesh_default():
        default = sft()
        assert default.mesh_sizes() == {}  # the backend's defaults: fsdp -1, ep 1, tp 1
        assert (default.mesh_shape(8).fsdp, default.mesh_shape(8).size) == (8, 8)
        assert sft(ep_size=2).mesh_shape(8) == sft(fsdp_size="auto", ep_size=2).mesh_shape(8)
        assert sft(ep_size=2).mesh_shape(8).fsdp == 4
        with pytest.raises(ValidationError, match=r"fsdp_size=-1 and tp_size=-1: at most one mesh size may be -1"):
            sft(tp_size="auto")
    tp_rest = sft(fsdp_size=2, tp_size="auto")
    assert tp_rest.mesh_sizes() == {"fully_sharded_data_parallel_size": 2, "tensor_parallel_size": -1}
    mesh = tp_rest.mesh_shape(8)
    assert (mesh.fsdp, mesh.ep, mesh.tp) == (2, 1, 4)
    with pytest.raises(ValueError, match=r"fsdp_size=3, ep_size=1, tp_size=1: their product 3 does not divide the 8"):
        sft(fsdp_size=3).mesh_shape(8)
    with pytest.raises(ValidationError, match="ep_size"):
        sft(ep_size=0)


def test_micro_batch_rows_must_divide_over_the_resolved_fsdp_size():
    """Refused when the job starts (it knows the devices then), before any model is loaded."""
    words = r"micro_batch_rows=2 must be a multiple of the mesh's fsdp size 8 \(mesh fsdp=8 ep=1 tp=1 over 8 devices\)"
    with production_mesh_default(), pytest.raises(ValueError, match=words):
        SFTTrainer(sft(micro_batch_rows=2))


def test_per_device_micro_batches_scale_with_the_fsdp_size(tmp_path):
    """On 8 devices (the default mesh: fsdp=8), SFT's micro_batch_rows_per_device=2 and RL's
    micro_train_batch_size_per_gpu=64 (examples/rl_tiny.yaml) become 16 and 512 rows per jit call."""
    with production_mesh_default():
        job = SFTTrainer(sft(micro_batch_rows_per_device=2))
        assert job.backend.mesh.shape["fsdp"] == 8 and job.backend.config.train_micro_batch_size == 16
        rl = RLTrainer(example(tmp_path))
        backend = rl.policy.backend
        assert backend.mesh.shape["fsdp"] == 8 and backend.config.train_micro_batch_size == 64 * 8
    with pytest.raises(ValidationError, match="set micro_batch_rows .* or micro_batch_rows_per_device .*not both"):
        sft(micro_batch_rows=2, micro_batch_rows_per_device=2)


def test_rl_mesh_fields_live_under_tx_and_errors_name_them():
    with production_mesh_default():
        with pytest.raises(ValidationError, match=r"tx.fsdp_size=-1 and tx.tp_size=-1: at most one mesh size"):
            RLConfig.model_validate({"tx": {"tp_size": "auto"}})
        cfg = RLConfig.model_validate({"tx": {"ep_size": 2}})
        assert cfg.tx.mesh_sizes() == {"expert_parallel_size": 2} and cfg.tx.mesh_shape(8).fsdp == 4
        with pytest.raises(ValueError, match=r"tx.fsdp_size=3, tx.ep_size=1, tx.tp_size=1: their product 3"):
            RLConfig.model_validate({"tx": {"fsdp_size": 3}}).tx.mesh_shape(8)
