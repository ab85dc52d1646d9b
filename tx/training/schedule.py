"""The learning-rate schedules of the seed's `optimizer_config.scheduler` (HF semantics), over optimizer steps.

`num_warmup_steps` steps of linear warmup (step s takes lr * (s + 1) / warmup), then `constant_with_warmup`
keeps lr, `cosine` and `linear` decay from lr at the end of warmup towards `min_lr_ratio * lr` at `total`.
"""

from __future__ import annotations

import math
from typing import Literal

Scheduler = Literal["constant_with_warmup", "cosine", "linear"]


def learning_rate(lr: float, step: int, total: int, scheduler: Scheduler = "constant_with_warmup",
                  warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> float:
    """The learning rate of 0-based optimizer step `step` of `total`."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if scheduler == "constant_with_warmup":
        return lr
    progress = (step - warmup_steps) / max(1, total - warmup_steps)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if scheduler == "cosine" else 1 - progress
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * shape)
