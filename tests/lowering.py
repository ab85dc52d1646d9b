"""Lowering tx's programs for another platform than this CPU host's, and reading the lowered module.

`lower(fn, platform, *args)` exports a jitted function with `jax.export` for one platform ("tpu", "cuda"):
it only traces and lowers (no compile, no device of that platform needed), which is where a Pallas TPU
kernel meets Mosaic's block-shape rules and where a host callback would appear. Arguments may be arrays or
`jax.ShapeDtypeStruct`s; `abstract(tree)` turns arrays into structs that keep their shardings.
"""

from __future__ import annotations

import re
from collections import Counter

import jax

# custom_call targets a host callback lowers to (jax.pure_callback / io_callback / debug.callback, old and FFI)
HOST_CALLBACK_TARGETS = ("xla_python_cpu_callback", "xla_ffi_python_cpu_callback", "xla_python_gpu_callback",
                         "xla_ffi_python_gpu_callback")
MOSAIC = "tpu_custom_call"

_TARGET = re.compile(r'stablehlo\.custom_call @([\w.$-]+)|call_target_name = "([^"]+)"')
_KERNEL_NAME = re.compile(r'kernel_name = "([^"]+)"')


def abstract(tree):
    """Each array leaf as a `ShapeDtypeStruct` with its sharding (other leaves as they are)."""
    def one(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(one, tree)


def lower(fn, platform: str, *args, **kwargs) -> str:
    """The StableHLO text of the jitted `fn` exported for `platform` with these (abstract) arguments."""
    return jax.export.export(fn, platforms=(platform,))(*args, **kwargs).mlir_module()


def custom_calls(module: str) -> Counter:
    """How often each custom_call target occurs in a lowered module."""
    return Counter(a or b for a, b in _TARGET.findall(module))


def mosaic_kernels(module: str) -> list[str]:
    """Names of the Mosaic kernels (`tpu_custom_call`s) of a module, in order."""
    return _KERNEL_NAME.findall(module)


def assert_no_host_callbacks(module: str) -> None:
    """No custom_call of the module calls back into Python on the host."""
    found = {t for t in custom_calls(module) if t in HOST_CALLBACK_TARGETS or "callback" in t.lower()}
    assert not found, f"host callbacks in a compiled program: {sorted(found)}"
