"""The (fsdp, ep, tp) mesh over the 8 virtual CPU devices: by default it spans every device (fsdp = devices /
(ep x tp)), one size may be -1 / 'auto' (the rest), bad sizes are refused naming the fields, a smaller mesh is
logged with its idle devices, the startup log names the mesh; `python -m tx.run` lets only the flags given
override --backend-config; full training logs the LoRA slot sizes it does not use. Mesh-only where possible
(`build_mesh` builds no model); two tiny backends."""

import json
import logging
import re

import jax
import pytest

import tx
from tests.helpers import production_mesh_default
from tx.backends.config import JaxBackendConfig
from tx.backends.jax import build_mesh
from tx.log import forget_warnings
from tx.models.sharding import resolve_mesh_shape

FIELDS = ("fully_sharded_data_parallel_size", "expert_parallel_size", "tensor_parallel_size")


def shape(mesh) -> tuple[int, int, int]:
    return mesh.shape["fsdp"], mesh.shape["ep"], mesh.shape["tp"]


@pytest.fixture
def fresh_warnings():
    forget_warnings()
    yield
    forget_warnings()


def test_default_mesh_spans_every_device_and_the_startup_log_names_it(tiny_dirs, caplog):
    """The users' default (the tests pin one device, tests/helpers.py): fsdp = 8 over all 8 devices, in the
    backend's log line and in tx.run's base_model_loaded event."""
    from tx.distributed.models import BaseModels, load_backends

    assert len(jax.devices()) == 8
    caplog.set_level(logging.INFO)
    with production_mesh_default():
        config = JaxBackendConfig(max_lora_adapters=2, max_lora_rank=1, max_seq_len=32)
    assert config.fully_sharded_data_parallel_size == -1
    backend = load_backends(BaseModels(base_model=tiny_dirs["dense"]), config, None)[tiny_dirs["dense"]]
    assert shape(backend.impl.mesh) == (8, 1, 1) and list(backend.impl.mesh.devices.flat) == jax.devices()
    want = "fsdp=8 ep=1 tp=1 over 8 devices (cpu x8) on 1 process"
    assert f"mesh {want}" in caplog.messages
    [event] = [json.loads(m) for m in caplog.messages if m.startswith('{"event": "base_model_loaded"')]
    assert event["mesh"] == want and "base_weights_mib" in event


def test_one_axis_sized_gives_fsdp_the_rest():
    with production_mesh_default():
        assert shape(build_mesh(JaxBackendConfig(expert_parallel_size=2))) == (4, 2, 1)
        assert shape(build_mesh(JaxBackendConfig(tensor_parallel_size=2, expert_parallel_size=2))) == (2, 2, 2)


@pytest.mark.parametrize("tp", [-1, "auto", "-1"])
def test_auto_takes_the_devices_the_others_leave(tp):
    config = JaxBackendConfig(fully_sharded_data_parallel_size=2, tensor_parallel_size=tp)
    assert config.tensor_parallel_size == -1
    mesh = build_mesh(config)
    assert shape(mesh) == (2, 1, 4) and mesh.devices.size == 8
    assert JaxBackendConfig.model_validate_json('{"fully_sharded_data_parallel_size": "auto", '
                                                '"tensor_parallel_size": 4}').mesh_shape(8).fsdp == 2


@pytest.mark.parametrize("sizes, words", [
    ((3, 1, 1), "fully_sharded_data_parallel_size=3, expert_parallel_size=1, tensor_parallel_size=1: their product "
                "3 does not divide the 8 devices"),
    ((-1, 3, 1), "fully_sharded_data_parallel_size=-1, expert_parallel_size=3, tensor_parallel_size=1: the sizes other "
                 "than -1 multiply to 3, which does not divide the 8 devices of the run, so "
                 "fully_sharded_data_parallel_size=-1 (auto) has no size"),
    ((4, 1, 4), "tensor_parallel_size=4: the mesh needs 16 devices; the run has 8"),
    ((-1, 16, 1), "expert_parallel_size=16, tensor_parallel_size=1: the sizes other than -1 need 16 devices"),
])
def test_sizes_that_do_not_divide_the_devices_are_refused_naming_the_fields(sizes, words):
    config = JaxBackendConfig(**dict(zip(FIELDS, sizes)))  # the sizes alone are valid: the devices decide
    with pytest.raises(ValueError, match=re.escape(words)):
        build_mesh(config)


def test_two_autos_and_non_sizes_are_refused_by_the_config():
    with pytest.raises(ValueError, match=r"fully_sharded_data_parallel_size=-1 and tensor_parallel_size=-1: at most "
                                         r"one mesh size may be -1 \(auto\)"):
        JaxBackendConfig(fully_sharded_data_parallel_size="auto", tensor_parallel_size=-1)
    for bad in (0, -2, "all"):
        with pytest.raises(ValueError, match="expert_parallel_size"):
            JaxBackendConfig(expert_parallel_size=bad)
    with pytest.raises(ValueError, match=r"a multi-process mesh must cover all 8 devices of the 2 processes, this one "
                                         r"covers 4"):
        resolve_mesh_shape(2, 1, 2, num_devices=8, num_processes=2)
    assert resolve_mesh_shape(-1, 1, 2, num_devices=8, num_processes=2).fsdp == 4


def test_a_smaller_mesh_asked_for_is_built_and_its_idle_devices_logged_once(caplog, fresh_warnings):
    caplog.set_level(logging.INFO)
    config = JaxBackendConfig(fully_sharded_data_parallel_size=2, tensor_parallel_size=2)
    assert shape(build_mesh(config)) == (2, 1, 2)
    build_mesh(config)
    idle = [r for r in caplog.records if "stay idle" in r.getMessage()]
    assert len(idle) == 1 and idle[0].levelno == logging.WARNING
    assert idle[0].getMessage().startswith("mesh fsdp=2 ep=1 tp=2 over 4 of 8 devices (cpu x4) on 1 process: 4 of "
                                           "the 8 devices stay idle (fully_sharded_data_parallel_size=2")


def test_micro_batch_rows_must_divide_over_the_resolved_fsdp(tiny_dirs):
    with production_mesh_default():
        config = JaxBackendConfig(train_micro_batch_size=4, expert_parallel_size=2)  # fsdp = 8 / 2 = 4: fine
        assert build_mesh(config).shape["fsdp"] == 4
        with pytest.raises(ValueError, match=r"train_micro_batch_size=2 must be a multiple of the mesh's fsdp size 8 "
                                             r"\(fully_sharded_data_parallel_size=-1\)"):
            tx.JaxBackend(tiny_dirs["dense"], JaxBackendConfig(train_micro_batch_size=2))


def run_config(*argv: str):
    from tx.run import backend_config, build_parser

    parser = build_parser()
    args = parser.parse_args(list(argv))
    return backend_config(args, parser), args


def test_run_flags_override_the_json_only_when_given(capsys):
    json_processes = '{"coordinator_address": "10.0.0.2:8476", "num_processes": 2, "tensor_parallel_size": 2}'
    config, args = run_config("--backend-config", json_processes)
    assert (config.coordinator_address, config.num_processes, config.tensor_parallel_size) == ("10.0.0.2:8476", 2, 2)
    assert (args.coordinator_address, args.num_processes) == ("10.0.0.2:8476", 2)  # the run starts with them
    config, _ = run_config("--backend-config", json_processes, "--num-processes", "2", "--tensor-parallel-size", "auto",
                           "--fully-sharded-data-parallel-size", "4")
    assert (config.num_processes, config.tensor_parallel_size, config.fully_sharded_data_parallel_size) == (2, -1, 4)
    with pytest.raises(SystemExit):
        run_config("--backend-config", json_processes, "--coordinator-address", "10.0.0.3:8476")
    assert ("--coordinator-address 10.0.0.3:8476 and --backend-config coordinator_address='10.0.0.2:8476' differ"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        run_config("--backend-config", '{"num_processes": 4}', "--num-processes", "2")
    assert "--num-processes 2 and --backend-config num_processes=4 differ" in capsys.readouterr().err
    with production_mesh_default(), pytest.raises(SystemExit):
        run_config("--tensor-parallel-size", "auto")  # fsdp is auto too
    assert "at most one mesh size may be -1" in capsys.readouterr().err


def test_run_checks_processes_from_the_json_too(capsys):
    from tx.run import backend_config, build_parser, validate_processes

    parser = build_parser()
    args = parser.parse_args(["--backend-config", '{"coordinator_address": "127.0.0.1:9", "num_processes": 2}'])
    backend_config(args, parser)  # before validate_processes, as main() does
    with pytest.raises(SystemExit):
        validate_processes(args, parser)
    assert "--coordinator-address, --num-processes and --process-id go together" in capsys.readouterr().err


def test_full_mode_logs_the_lora_slot_sizes_it_does_not_use(tiny_dirs, caplog, fresh_warnings):
    """training_mode='full' has no adapters: its model carries 2 slots of rank 1. A value given otherwise is
    logged once by name (not refused: one command line serves both modes), a default is not; the config holds
    what runs, also after a model_copy into full mode (which skips validation) and on the workers it is sent to."""
    caplog.set_level(logging.INFO)
    quiet = JaxBackendConfig(training_mode="full")
    assert (quiet.max_lora_adapters, quiet.max_lora_rank) == (2, 1) and not caplog.records
    given = JaxBackendConfig(training_mode="full", max_lora_adapters=24, max_lora_rank=8)
    assert (given.max_lora_adapters, given.max_lora_rank) == (2, 1)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "max_lora_adapters=24 is not used with training_mode='full' (no LoRA adapters: every base weight trains); "
        "it runs with max_lora_adapters=2",
        "max_lora_rank=8 is not used with training_mode='full' (no LoRA adapters: every base weight trains); it runs "
        "with max_lora_rank=1"]
    assert JaxBackendConfig.model_validate(given.model_dump()) == given  # as a worker decodes it: nothing to log
    caplog.clear()
    copied = JaxBackendConfig(max_lora_rank=16, max_seq_len=32).model_copy(update={"training_mode": "full"})
    backend = tx.FullBackend(tiny_dirs["dense"], copied)
    assert (backend.config.max_lora_adapters, backend.config.max_lora_rank) == (2, 1)
    assert any("max_lora_rank=16 is not used with training_mode='full'" in m for m in caplog.messages)
