"""Which process plays which role in a multi-process run: the one source of ranks (core layer: imports
nothing from tx, so checkpoints and backends may use it as well as distributed and run).

A process has two ranks, and on a TPU pod they can differ:

- the **launch rank**: the `process_id` this process gave `jax.distributed.initialize` (`--process-id`), or
  the one that call detected (`--auto-distributed`: TPU metadata, SLURM, ...). JAX's coordination service
  runs on launch rank 0, so the coordinator address names that process's host;
- **`jax.process_index()`**: the launch rank on CPU and GPU, but on TPU it follows the slice's topology
  (a v6e 4x4 pod gave `process_index() == 0` to a host launched with another `--process-id`).

Roles:

- `is_coordinator()` (launch rank 0): the engine and HTTP API, the control channel's listener (it binds on
  the coordinator address's interface, which only that host has) and the loopback run's per-launch secret.
  Workers are the other launch ranks and join the control channel under `launch_rank()`, so the
  coordinator expects exactly ranks 1..N-1 and its errors name processes as they were launched;
- `is_primary_writer()` (`jax.process_index() == 0`): the process that writes what is written once
  (checkpoint metadata and LATEST pointers, exported models, sampler tarballs). It is the primary host of
  orbax (which writes its own metadata and renames the finished checkpoint on `jax.process_index() == 0`)
  and the source of `jax.experimental.multihost_utils.broadcast_one_to_all`, so our writes and theirs
  come from one process. Multi-host checkpoints live on storage every host shares, so which host writes
  them does not matter to the engine that later reads them.

Without `jax.distributed` (one process, or a runtime that connected the hosts itself) there is no launch
rank and both roles follow `jax.process_index()`; `describe()` says which source is in use.
"""

from __future__ import annotations

import logging

import jax

logger = logging.getLogger(__name__)


def _distributed_process_id() -> int | None:
    """The process_id jax.distributed.initialize used (given or detected); None when it was not called."""
    from jax._src import distributed

    state = distributed.global_state
    return state.process_id if getattr(state, "client", None) is not None else None


def launch_rank() -> int:
    """This process's launch rank (see the module docstring); `jax.process_index()` without jax.distributed."""
    process_id = _distributed_process_id()
    return jax.process_index() if process_id is None else process_id


def jax_rank() -> int:
    return jax.process_index()


def is_coordinator() -> bool:
    """Whether this process runs the engine, the API and the control channel's listener (launch rank 0)."""
    return launch_rank() == 0


def is_primary_writer() -> bool:
    """Whether this process writes what is written once (jax.process_index() 0, orbax's primary host)."""
    return jax.process_index() == 0


def describe(source: str | None = None) -> dict:
    """Both ranks, where the launch rank came from and the roles they give this process. `source` names
    how the launch rank was given (e.g. "--process-id"); default: jax.distributed's process_id, or
    jax.process_index() when jax.distributed was not initialized."""
    process_id = _distributed_process_id()
    if process_id is None:
        source = "jax.process_index() (jax.distributed not initialized: no launch rank)"
    launch = jax.process_index() if process_id is None else process_id
    return {"launch_rank": launch, "jax_process_index": jax.process_index(),
            "launch_rank_source": source or "jax.distributed.initialize's process_id",
            "coordinator": launch == 0, "primary_writer": jax.process_index() == 0}


def log_ranks(source: str | None = None, *, always: bool = False) -> dict:
    """Log this process's ranks and roles once at startup: when the two ranks differ, or `always` (e.g.
    when the launch rank was detected rather than given). Returns `describe(source)`."""
    info = describe(source)
    if always or info["launch_rank"] != info["jax_process_index"]:
        logger.info("launch rank %d is jax.process_index() %d (launch rank from %s): %s; %s",
                    info["launch_rank"], info["jax_process_index"], info["launch_rank_source"],
                    "this process runs the engine and the control channel" if info["coordinator"]
                    else "this process is a worker (the engine runs on launch rank 0)",
                    "it writes the checkpoints (jax.process_index() 0, orbax's primary host)"
                    if info["primary_writer"] else "jax.process_index() 0 writes the checkpoints")
    return info
