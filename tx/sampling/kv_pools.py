"""The paged engine's KV page pools on the device: `[layers, pages, page, *entry]` per layer stack and
`kv_layout` entry, zero-filled, their zero pages handed back to the system on CPU (`release_zero_pages`)."""

from __future__ import annotations

from typing import Any

from tx.models.sharding import zeros_global
from tx.runtime import release_zero_pages


def make_pools(model: Any, mesh: Any, num_pages: int, page: int) -> tuple[list[tuple], int, int]:
    """The pools per stack of `model`; the bytes made and the bytes handed back (resident once written)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    dtype = jnp.dtype(model.embed_tokens.embedding[...].dtype)
    out, made, released = [], 0, 0
    # per `kv_layout`: kv heads split like the attention's keys/values (tp); every page on every fsdp device
    for stack in model.stacks:
        pools = []
        for entry, names in model.kv_layout():
            shape = (len(stack.layer_ids), num_pages, page, *entry)
            layout = NamedSharding(mesh, model.layout.spec(("layers", None, None, *names), shape))
            pools.append(zeros_global(shape, dtype, layout))  # XLA's buffers: donated to every call
            # one pool at a time: while made, a pool is resident whole (zero-filled)
            made += sum(shard.data.nbytes for shard in pools[-1].addressable_shards)
            released += release_zero_pages(pools[-1])
        out.append(tuple(pools))
    return out, made, released
