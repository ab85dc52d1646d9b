"""`python -m tx.run` as on a TPU pod, whose `jax.process_index()` follows the slice's topology and not the
`--process-id` the process was launched with (test helper for test_rank_permuted.py).

    python tests/distributed/permuted_run.py PERMUTATION [tx.run arguments ...]

PERMUTATION, e.g. "1,0": the process launched with `--process-id i` sees `jax.process_index() ==
PERMUTATION[i]`. The hosts of a pod are separate machines, and only the host launched with `--process-id 0`
owns the coordinator address: here a process launched with another id cannot listen on that address
(socket.create_server fails with EADDRNOTAVAIL, as bind() does on a host without that interface).
"""

import errno
import runpy
import socket
import sys

import jax

permutation = [int(p) for p in sys.argv[1].split(",")]
args = sys.argv[2:]
launch_rank = int(args[args.index("--process-id") + 1])
coordinator_host = args[args.index("--coordinator-address") + 1].rpartition(":")[0]
assert sorted(permutation) == list(range(len(permutation))), f"{permutation} is not a permutation"

jax.process_index = lambda backend=None: permutation[launch_rank]

_create_server = socket.create_server


def _create_server_on_own_host(address, *a, **kw):
    if launch_rank != 0 and address[0] == coordinator_host:
        raise OSError(errno.EADDRNOTAVAIL, f"Cannot assign requested address {address[0]} (simulated pod: it "
                                           "belongs to the host launched with --process-id 0)")
    return _create_server(address, *a, **kw)


socket.create_server = _create_server_on_own_host
sys.argv = ["tx.run", *args]
runpy.run_module("tx.run", run_name="__main__", alter_sys=True)
