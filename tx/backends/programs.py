"""The last call of each compiled program, kept so that tests and tools can lower the real programs.

`ProgramLog` records, per program name, the jitted function and its arguments reduced to shape, dtype and
sharding (no device buffers are kept); `lowered(name)` lowers it again for those arguments. Off by default:
recording costs a tree walk per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def _abstract(x: Any) -> Any:
    """An array's shape, dtype and sharding (what lowering needs); anything else as it is."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x


class ProgramLog:
    def __init__(self) -> None:
        self.enabled = False
        self._calls: dict[str, tuple[Callable, Any, dict]] = {}

    def record(self, name: str, fn: Callable, args: tuple, kwargs: dict) -> None:
        if self.enabled:
            self._calls[name] = (fn, jax.tree.map(_abstract, args), kwargs)

    def lowered(self, name: str) -> jax.stages.Lowered:
        """The program `name` ("forward_backward", "optim_step", "sample_decode", ...) lowered for the
        arguments of its last recorded call."""
        if name not in self._calls:
            raise KeyError(f"no recorded call of program {name!r} (set programs.enabled = True before calling it); "
                           f"recorded: {', '.join(sorted(self._calls)) or 'none'}")
        fn, args, kwargs = self._calls[name]
        return fn.lower(*args, **kwargs)
