"""The paged engine's first-token buffer: each admitted prompt's last token's final hidden state, from the prefill
call that writes that token until its rows' first decode calls read it (`paged_step`: `prefill_chunk` writes
row `first_r`, `decode_steps` reads row `first_s`). A row's first token is chosen from it, so a prompt's last
token goes through the model once, in the prefill, not once more per row in a decode step."""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tx.models.sharding import zeros_global


class FirstTokens:
    """float32 `[size, d]` on the device, replicated (made at first use), and which of its rows are free. The
    scheduler holds a row per admitted prompt (`PagedEngine._admit_group` takes it, the prompt's last row taking
    a slot or its unadmission gives it back); at most one prompt more than the decode slots waits for them
    (`PagedEngine._admit_groups`), so `size` = slots + 2 never runs out."""

    def __init__(self, size: int, hidden: int, mesh: Any) -> None:
        self.size, self.hidden, self.mesh = size, hidden, mesh
        self.array: Any = None
        self.free: list[int] = []
        self.reset()

    def reset(self) -> None:
        """Every row free; the array remade at its next use (a failed call may have consumed the donated one)."""
        self.array = None
        self.free = list(range(self.size - 1, -1, -1))

    def get(self) -> Any:
        """The device array (donated to prefill calls: put the one they return back in `array`)."""
        if self.array is None:
            self.array = zeros_global((self.size, self.hidden), np.float32, NamedSharding(self.mesh, PartitionSpec()))
        return self.array

    def take(self) -> int:
        """A free row, for an admitted prompt."""
        if not self.free:
            raise RuntimeError(f"every one of the {self.size} first-token rows is held: more prompts admitted than "
                               "the scheduler allows")
        return self.free.pop()

    def give(self, index: int) -> None:
        """Row `index` (-1: none) is free again."""
        if index >= 0:
            self.free.append(index)
