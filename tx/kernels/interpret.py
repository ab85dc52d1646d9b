"""Whether a Pallas TPU kernel runs compiled or in Pallas interpret mode, decided once for all of them.

The decision follows the platform the program is built for, passed in explicitly (`tx.kernels.platform`:
the model's, i.e. its mesh's; never `jax.default_backend()` read while tracing): the Pallas TPU kernels
(splash attention, megablox grouped matmul, ragged paged attention) are compiled (`interpret=False`, a
Mosaic `tpu_custom_call` in the lowered program) exactly when that platform is "tpu". On any other platform
they run in interpret mode: correct, slow, how the CPU tests check them. "auto" never picks them there, so
getting one means it was asked for by name; that is logged once per (config field, kernel, platform).
A program built for "tpu" can be lowered on a CPU host (`jax.export`, as tests/kernels/test_lowering.py
does) but only runs on a TPU.
"""

from __future__ import annotations

import logging

from tx.kernels.platform import normalise
from tx.log import warn_once

logger = logging.getLogger(__name__)


def default_interpret(field: str, impl: str, platform: str) -> bool:
    """False on "tpu" (the kernel is compiled); True elsewhere, after warning once that `field=impl` runs
    interpreted on `platform`."""
    platform = normalise(platform)
    if platform == "tpu":
        return False
    warn_once((field, impl, f"platform={platform}"),
              f"{field}={impl!r} on {platform}: running the Pallas kernel in interpret mode (slow; for tests)",
              logger=logger)
    return True
