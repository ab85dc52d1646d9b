"""The platform a program is built for, named the way `jax.export` names it: "cpu", "cuda", "rocm" or "tpu".

Kernel dispatch (attention, grouped matmul, paged attention) takes this name as an argument instead of
asking `jax.default_backend()` while it traces, so a program is built for the devices it will run on (the
mesh's), and can be lowered for another platform than the host's: `jax.export.export(fn,
platforms=("tpu",))` on a CPU machine traces the TPU kernels when the model was built for "tpu". The
model, its MoE layers and the training backends resolve the platform once, when they are built
(`platform_of(mesh)`), and carry it as static data.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
_ALIASES = {"gpu": "cuda"}  # what `Device.platform` and `jax.default_backend()` call an NVIDIA GPU


def normalise(name: str) -> str:
    """`name` as one of `PLATFORMS` ("gpu" -> "cuda", any case); an unknown name is refused."""
    lowered = str(name).lower()
    platform = _ALIASES.get(lowered, lowered)
    if platform not in PLATFORMS:
        raise ValueError(f"platform={name!r} is not one of {', '.join(PLATFORMS)} (or 'gpu' for 'cuda')")
    return platform


def platform_of(where: Any = None) -> str:
    """The normalised platform of a `Mesh`, a device, or an iterable of devices (default: JAX's first
    device). Devices of different platforms are refused."""
    if where is None:
        devices = jax.devices()[:1]
    elif hasattr(where, "devices") and hasattr(where.devices, "flat"):  # a Mesh: devices is an ndarray
        devices = list(where.devices.flat)
    elif hasattr(where, "platform"):
        devices = [where]
    else:
        devices = list(where) if isinstance(where, Iterable) else [where]
    found = {normalise(d.platform) for d in devices}
    if len(found) != 1:
        raise ValueError(f"devices of one program must share a platform, got {sorted(found) or 'no devices'}")
    return found.pop()


def resolve(platform: str | None) -> str:
    """`platform` normalised, or (None) the platform of JAX's first device: the default of the kernel
    functions for callers that build no model (tests, benchmarks); tx's model and backends always pass one."""
    return platform_of() if platform is None else normalise(platform)
