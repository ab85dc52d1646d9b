"""tx.ranks: the launch rank (jax.distributed's process_id) and jax.process_index() give each role to exactly
one process, also when a TPU pod permutes them; the real two-process run is tests/distributed/
test_rank_permuted.py."""

import logging
import re
from pathlib import Path

import jax
import pytest
from jax._src import distributed

from tx import ranks


@pytest.fixture
def pod(monkeypatch):
    """Pretend jax.distributed was initialized with `launch` while jax.process_index() says `jax_rank`."""

    def set_ranks(launch: int, jax_rank: int) -> None:
        monkeypatch.setattr(distributed.global_state, "client", object())
        monkeypatch.setattr(distributed.global_state, "process_id", launch)
        monkeypatch.setattr(jax, "process_index", lambda backend=None: jax_rank)

    return set_ranks


def test_one_process_without_jax_distributed_plays_every_role(caplog):
    assert distributed.global_state.client is None  # the test session never initializes jax.distributed
    assert ranks.launch_rank() == ranks.jax_rank() == 0
    assert ranks.is_coordinator() and ranks.is_primary_writer()
    info = ranks.describe("--process-id")
    assert info["launch_rank_source"].startswith("jax.process_index() (jax.distributed not initialized")
    with caplog.at_level(logging.INFO, logger="tx.ranks"):
        ranks.log_ranks()
    assert caplog.records == []  # the ranks agree: nothing to say


@pytest.mark.parametrize("permutation", [(1, 0), (2, 0, 1), (0, 2, 1)])
def test_each_role_falls_to_exactly_one_process_of_a_permuted_pod(pod, permutation):
    coordinators, writers = [], []
    for launch, jax_rank in enumerate(permutation):
        pod(launch, jax_rank)
        assert ranks.launch_rank() == launch and ranks.jax_rank() == jax_rank
        coordinators += [launch] if ranks.is_coordinator() else []
        writers += [launch] if ranks.is_primary_writer() else []
    assert coordinators == [0]  # the engine and control channel: the coordinator address's host
    assert writers == [permutation.index(0)]  # once-only writes: orbax's primary host, jax.process_index() 0


def test_differing_ranks_are_logged_with_both_numbers_and_the_roles(pod, caplog):
    pod(launch=1, jax_rank=0)
    with caplog.at_level(logging.INFO, logger="tx.ranks"):
        info = ranks.log_ranks("--process-id")
    assert info == {"launch_rank": 1, "jax_process_index": 0, "launch_rank_source": "--process-id",
                    "coordinator": False, "primary_writer": True}
    (record,) = caplog.records
    assert record.getMessage().startswith("launch rank 1 is jax.process_index() 0 (launch rank from --process-id): "
                                          "this process is a worker")
    assert "it writes the checkpoints" in record.getMessage()


def test_agreeing_ranks_are_logged_only_when_asked(pod, caplog):
    pod(launch=0, jax_rank=0)
    with caplog.at_level(logging.INFO, logger="tx.ranks"):
        ranks.log_ranks("--process-id")
        assert caplog.records == []
        ranks.log_ranks("--auto-distributed: the process id jax.distributed.initialize() detected", always=True)
    (record,) = caplog.records
    assert "launch rank 0 is jax.process_index() 0 (launch rank from --auto-distributed" in record.getMessage()
    assert "runs the engine" in record.getMessage()


def test_roles_are_decided_only_in_tx_ranks():
    """Every `jax.process_index()` role test of the package goes through tx.ranks."""
    root = Path(ranks.__file__).parent
    callers = {str(p.relative_to(root)) for p in root.rglob("*.py")
               if re.search(r"\bprocess_index\(\)", re.sub(r"(?s)\"\"\".*?\"\"\"|#[^\n]*", "", p.read_text()))}
    assert callers == {"ranks.py"}, callers
