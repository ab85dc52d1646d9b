"""Whether a Pallas TPU kernel runs compiled or in Pallas interpret mode, decided once for all of them.

Off TPU the Pallas TPU kernels (splash attention, megablox grouped matmul, paged attention) run in
interpret mode: correct, slow, how the CPU tests check them. "auto" never picks them there, so getting
one means it was asked for by name; that is logged once per (config field, kernel, platform).
"""

from __future__ import annotations

import logging

import jax

from tx.log import warn_once

logger = logging.getLogger(__name__)


def default_interpret(field: str, impl: str) -> bool:
    """True off TPU, after warning once that `field=impl` runs interpreted there."""
    platform = jax.default_backend()
    if platform == "tpu":
        return False
    warn_once((field, impl, f"platform={platform}"),
              f"{field}={impl!r} on {platform}: running the Pallas kernel in interpret mode (slow; for tests)",
              logger=logger)
    return True
