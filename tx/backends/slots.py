"""Adapter slot bookkeeping: which slot each model holds, and an LRU of slots lent to sampler checkpoints.

Slot 0 is the base model. Training models own their slots; sampler checkpoints (weights saved for
sampling) are loaded into otherwise free slots and evicted least-recently-used when a slot is needed,
so sampling an old checkpoint never touches a live training adapter.
"""

from __future__ import annotations

from collections import OrderedDict


class SlotTable:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(1, num_slots))
        self.sampler: OrderedDict[str, int] = OrderedDict()  # checkpoint path -> slot, least recent first

    def take(self) -> int | None:
        """A slot for a new model: a free one, else one evicted from the sampler cache; None if all are
        held by models."""
        if self._free:
            return self._free.pop(0)
        if self.sampler:
            return self.sampler.popitem(last=False)[1]
        return None

    def release(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort()

    def cached(self, path: str) -> int | None:
        if path in self.sampler:
            self.sampler.move_to_end(path)
            return self.sampler[path]
        return None

    def lend(self, path: str, pinned: set[int]) -> int | None:
        """A slot for sampler checkpoint `path`: free, or the least recently used cached one not in
        `pinned` (slots the current batch still needs)."""
        slot = self._free.pop(0) if self._free else None
        if slot is None:
            for old_path, old_slot in self.sampler.items():
                if old_slot not in pinned:
                    del self.sampler[old_path]
                    slot = old_slot
                    break
        if slot is not None:
            self.sampler[path] = slot
        return slot

    def forget(self, path: str) -> int | None:
        """Drop a cached checkpoint (it was overwritten); its slot becomes free."""
        slot = self.sampler.pop(path, None)
        if slot is not None:
            self.release(slot)
        return slot
