"""Shared fixtures: tiny random Qwen3 checkpoints written to a temp dir, 8 CPU devices for sharding, and
one-device backends unless a test asks for a mesh."""

import os
import tempfile

from tests.helpers import TESTS_CPU_MOE_IMPL, cpu_xla_flags, pin_mesh_default, set_cpu_moe_auto

# Must happen before jax is imported anywhere (tests.helpers imports only numpy): 8 host devices so mesh
# tests run on this CPU.
os.environ.setdefault("XLA_FLAGS", cpu_xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, its xdist workers and every subprocess (servers, hosts of
# multi-host runs): a program that several tests compile is compiled once. With a size bound JAX locks the
# folder for each read and write, so processes share it safely. The 0.3 s floor matters: with none (every program
# written) a full run took 1,200 s instead of 885 s, in-process kernel and sampling files 3-7x slower as the folder
# filled with the suite's tens of thousands of tiny programs.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "tx-tests-compile-cache"))
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest

from tx.models.tiny import TinySpec, write_tiny_model

# Before any test module builds a config: backends run on one device unless a test sizes its mesh (the
# production default spans all 8 devices; see tests/helpers.py).
pin_mesh_default()
# ... and MoE models run ragged_dot on CPU unless a test is marked `production_moe_kernel` (see tests/helpers.py)
set_cpu_moe_auto(TESTS_CPU_MOE_IMPL)


@pytest.fixture(autouse=True)
def _cpu_moe_kernel(request):
    """Tests marked `production_moe_kernel` build MoE models with tx's own CPU pick (`blocked`)."""
    if request.node.get_closest_marker("production_moe_kernel") is None:
        yield
        return
    set_cpu_moe_auto(None)
    try:
        yield
    finally:
        set_cpu_moe_auto(TESTS_CPU_MOE_IMPL)


# name -> spec; covers tied/untied, GQA ratio 1 and 2, MoE with/without norm_topk_prob, mixed dense/MoE
# layers, and a sharded safetensors checkpoint.
TINY_SPECS = {
    "dense": TinySpec(),
    "dense_tied_mha": TinySpec(tie_word_embeddings=True, num_kv_heads=4, seed=1),
    "moe": TinySpec(moe=True, seed=2, shards=3),
    "moe_no_norm_mixed": TinySpec(
        moe=True, norm_topk_prob=False, num_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], seed=3
    ),
}


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: str(write_tiny_model(root / name, spec)) for name, spec in TINY_SPECS.items()}


# The other families, for the tests that run every family (not in `tiny_dir`'s parametrization): Llama 3 with
# Llama 3.1's RoPE scaling; DeepSeek-V3 (latent attention, grouped routing, a shared expert) with MoE layers only,
# one layer stack, as the dense first layers add compile time and nothing a multi-host run could break.
FAMILY_SPECS = {
    "llama": TinySpec(family="llama", llama3_rope=True, max_position_embeddings=1024, seed=4),
    "deepseek_v3": TinySpec(family="deepseek_v3", num_layers=2, first_k_dense_replace=0, seed=6),
}


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {name: str(write_tiny_model(root / name, spec)) for name, spec in FAMILY_SPECS.items()}


@pytest.fixture(params=list(TINY_SPECS))
def tiny_dir(request, tiny_dirs) -> str:
    return tiny_dirs[request.param]


# The slowest files (minutes each: subprocess hosts, servers, recipes, many mesh shapes) are handed to the xdist
# workers first; picked up last, one of them would keep a worker busy while the other has nothing left to run.
SLOW_FILES_FIRST = (  # by their cold-cache time in a full run (2026-11-28), longest first
    "distributed/test_multihost_parity.py", "api/test_recipes.py", "api/test_service.py",
    "models/test_deepseek_v3.py", "distributed/test_multihost.py", "rl/test_service.py",
    "backends/test_precompile.py", "backends/test_full.py", "sampling/test_sample.py", "backends/test_lowering.py",
    "rl/test_trainer.py", "test_runtime.py", "backends/test_jax_backend.py", "sft/test_trainer.py",
    "models/test_collectives.py", "api/test_hostile.py", "rl/test_trainer_runs.py", "sampling/test_paged_engine.py",
    "checkpoints/test_sampler.py", "models/test_qwen3_parity.py", "test_device_suite.py",
    "sampling/test_continuous.py", "api/test_continuous_sdk.py", "checkpoints/test_sampler_faults.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))  # stable
