"""Once-per-process warnings (core layer: imports nothing from tx).

`warn_once(key, message)` logs `message` as a WARNING the first time `key` is seen in this process and
does nothing after. Kernels call it at trace/dispatch time when something other than the asked-for
kernel runs (design: "no silent fallbacks ... logged once, naming what runs instead"): the key is
`(config field, impl, reason)`, so each distinct fallback is reported once however often it is traced.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

_lock = threading.Lock()
_seen: set[Hashable] = set()


def warn_once(key: Hashable, message: str, *, logger: logging.Logger | None = None) -> bool:
    """Log `message` (WARNING, on `logger`, default the "tx" logger) unless `key` was warned about
    before in this process; True when it logged."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    (logger or logging.getLogger("tx")).warning(message)
    return True


def warned(key: Hashable) -> bool:
    """Whether `key` has been warned about in this process."""
    return key in _seen


def forget_warnings() -> None:
    """Forget every key, so each warning logs again (for tests)."""
    with _lock:
        _seen.clear()
