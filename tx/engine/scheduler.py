"""Which accepted requests run next, and together.

Per model, requests run in `seq_id` order (seq 0 is the model's creation); later seq_ids wait for the
missing ones. Each round takes, per model, either its run of consecutive passes of one kind (several
forward_backward chunks batch together) or its next single op (optim_step, save, load, create). The
passes of every model are merged into one backend call per kind: the cross-tenant batch. A pass never
crosses the same model's earlier optim_step or load because those are singles that end the run.
Sampling requests have no order between them; all queued ones go into one call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tx.engine.ops import PASS_KINDS, Op

logger = logging.getLogger(__name__)


@dataclass
class Round:
    passes: dict[str, list[Op]] = field(default_factory=lambda: {k: [] for k in PASS_KINDS})
    singles: list[Op] = field(default_factory=list)
    samples: list[Op] = field(default_factory=list)

    def empty(self) -> bool:
        return not (any(self.passes.values()) or self.singles or self.samples)


@dataclass
class _ModelQueue:
    next_seq: int = 0
    waiting: dict[int, Op] = field(default_factory=dict)
    blocked_since: float | None = None  # when a later seq_id first waited for a missing one


class Scheduler:
    def __init__(self, max_pass_datums: int = 4096, max_samples: int = 1024, seq_gap_timeout_s: float = 120.0,
                 max_pass_tokens: int = 1 << 20):
        self.max_pass_datums = max_pass_datums
        self.max_pass_tokens = max_pass_tokens
        self.max_samples = max_samples
        self.seq_gap_timeout_s = seq_gap_timeout_s
        self.models: dict[str, _ModelQueue] = {}
        self.samples: list[Op] = []
        self.controls: list[Op] = []
        self._turn = 0

    def expected_seq(self, model_id: str) -> int | None:
        queue = self.models.get(model_id)
        return None if queue is None else queue.next_seq

    def add(self, op: Op) -> None:
        """Queue `op` (its seq_id was checked by the caller: not yet executed, not a duplicate)."""
        if op.kind == "sample":
            self.samples.append(op)
            return
        if op.seq_id is None:  # unsequenced control ops (unload) run in the next round
            self.controls.append(op)
            return
        self.models.setdefault(op.model_id, _ModelQueue()).waiting[op.seq_id] = op

    def drop_model(self, model_id: str) -> list[Op]:
        """Forget a model; returns its queued ops (to be failed)."""
        queue = self.models.pop(model_id, None)
        return [] if queue is None else list(queue.waiting.values())

    def pending(self, now: float) -> bool:
        """Whether a round now would run something (a model waiting on a missing seq_id is not work
        until its gap times out)."""
        if self.samples or self.controls:
            return True
        return any(q.next_seq in q.waiting or (q.blocked_since is not None and now - q.blocked_since >= self.seq_gap_timeout_s)
                   for q in self.models.values() if q.waiting)

    def next_deadline(self) -> float | None:
        """When the earliest seq_id gap times out (None: no model is blocked)."""
        times = [q.blocked_since + self.seq_gap_timeout_s for q in self.models.values()
                 if q.waiting and q.blocked_since is not None]
        return min(times, default=None)

    def ready_pass_models(self) -> set[str]:
        """Models whose next request is a forward or forward_backward that could run now."""
        return {m for m, q in self.models.items()
                if (head := q.waiting.get(q.next_seq)) is not None and head.kind in PASS_KINDS}

    def depth(self) -> tuple[int, int, int]:
        """(sequenced and control ops queued, sampling requests queued, their sequences)."""
        return (sum(len(q.waiting) for q in self.models.values()) + len(self.controls), len(self.samples),
                sum(op.size for op in self.samples))

    def has_ready_passes(self) -> bool:
        return bool(self.ready_pass_models())

    def next_round(self, now: float) -> Round:
        out = Round()
        datums = {k: 0 for k in PASS_KINDS}
        tokens = {k: 0 for k in PASS_KINDS}
        # start at a different model each round so that no tenant can keep others out of a full round
        order = list(self.models.items())
        self._turn = (self._turn + 1) % max(1, len(order))
        for model_id, queue in order[self._turn:] + order[:self._turn]:
            self._skip_gap(model_id, queue, now)
            head = queue.waiting.get(queue.next_seq)
            if head is None:
                continue
            if head.kind not in PASS_KINDS:
                out.singles.append(queue.waiting.pop(queue.next_seq))
                queue.next_seq += 1
                continue
            while (op := queue.waiting.get(queue.next_seq)) is not None and op.kind == head.kind:
                if out.passes[head.kind] and (datums[head.kind] + op.size > self.max_pass_datums
                                              or tokens[head.kind] + op.tokens > self.max_pass_tokens):
                    break
                out.passes[head.kind].append(queue.waiting.pop(queue.next_seq))
                datums[head.kind] += op.size
                tokens[head.kind] += op.tokens
                queue.next_seq += 1
        out.singles += self.controls  # after the model's own ops taken above (unload comes last)
        self.controls = []
        taken = 0
        while self.samples and (not out.samples or taken + self.samples[0].size <= self.max_samples):
            op = self.samples.pop(0)
            out.samples.append(op)
            taken += op.size
        return out

    def _skip_gap(self, model_id: str, queue: _ModelQueue, now: float) -> None:
        """A seq_id the client burnt (it failed before sending) would block the model forever: after
        `seq_gap_timeout_s` the next waiting request goes ahead."""
        if not queue.waiting or queue.next_seq in queue.waiting:
            queue.blocked_since = None
            return
        if queue.blocked_since is None:
            queue.blocked_since = now
        elif now - queue.blocked_since >= self.seq_gap_timeout_s:
            first = min(queue.waiting)
            logger.warning("model %s: seq_id %d..%d never arrived in %.0f s; continuing at %d", model_id,
                           queue.next_seq, first - 1, self.seq_gap_timeout_s, first)
            queue.next_seq = first
            queue.blocked_since = None
