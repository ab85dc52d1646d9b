"""The paged engine's rows as it tracks them: a row from `add` to its end (`Row`, its `RowResult`), the rows
reading one prompt's pages (`Group`), and a row holding a decode slot (`Live`). `continuous.PagedEngine`
moves them between its queues; `paged_calls.PagedDevice` packs them into device calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tx.sampling.requests import SampleRow


@dataclass
class RowResult:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # ended on a stop token (else max_tokens)
    cached_prompt_tokens: int = 0  # of its request's prompt, read from the prefix cache
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


@dataclass(eq=False)  # compared by identity
class Row:
    """One sampled sequence from `add` to its end."""

    spec: SampleRow
    tag: Any  # the caller's name for it, returned with its result
    serial: int  # order of arrival (preemption takes the youngest)
    result: RowResult = field(default_factory=lambda: RowResult([], [], False))


@dataclass(eq=False)  # compared by identity
class Group:
    """Rows that read one prompt's pages (positions 0 .. n-1, all of it): a request's rows, or a resumed row
    whose prompt is its request's prompt + the tokens it had sampled. The prefill call that writes its last
    token also keeps that token's final hidden state at index `first` of the engine's first-token buffer:
    each row's first token is chosen from it (`Live.first`)."""

    rows: list[Row]  # not yet given a slot
    prompt: np.ndarray
    adapter: int
    identity: str | None = None  # the weights its KV is computed with (prefix-cache key); None: not shared
    pages: list[int] = field(default_factory=list)
    prefilled: int = 0
    cached: int | None = None  # prompt tokens read from the prefix cache when first admitted
    live: int = 0  # rows holding a slot
    resumed: bool = False
    tenant: str = ""  # who sent it (fair admission)
    first: int = -1  # its slot in the first-token buffer while admitted (-1: none)

    @property
    def prefix(self) -> int:
        """Positions its pages hold: the whole prompt."""
        return len(self.prompt)

    @property
    def ready(self) -> bool:
        return self.prefilled >= self.prefix


@dataclass(eq=False)  # compared by identity
class Live:
    row: Row
    group: Group
    table: list[int]
    own: list[int]  # pages only this row holds
    pos: int  # position of the next input token
    token: int  # the next input token
    last: int  # the last position this row may write (prompt + max_tokens - 2)
    copy: tuple[int, int] | None = None  # (src, dst) page copy its first decode call makes
    # its group's first-token buffer slot until its first decode call: that call's first step chooses the row's
    # first token from the hidden state there instead of running its input (the prompt's last token, at `pos`,
    # whose K/V the prefill wrote) through the layers; -1 after
    first: int = -1
    alive: bool = True  # False once it ended or was preempted (a call dispatched before may still hold its slot)
