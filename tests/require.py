"""Skips that CI turns into failures, so that no claim rests on a test that skipped silently.

A test whose prerequisite is missing (an optional package, a PostgreSQL server, an SDK that .ci/run installs)
calls `skip_or_fail(reason)` or `require_module(name)`: it skips on a developer's machine, and fails with the
same reason when TX_REQUIRE_ALL=1, which .ci/run sets for the test suite (CI installs every prerequisite).

Deliberate opt-ins (tests/models/test_long_parity.py's TX_LONG_PARITY / TX_LONG_PARITY_16K) and hardware
skips (the TPU-only checks in tests/kernels/test_fallback_warnings.py) are not prerequisites and do not use
this: they skip in CI too, by design.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

ENV = "TX_REQUIRE_ALL"
# where CI gets each optional package from (by top-level name), for the skip/fail message
HINTS = {
    "tinker_cookbook": "pip install --no-deps tinker-cookbook==0.6.1 (as .ci/run does; its dependencies are in the "
    "dev extra)",
    "peft": "pip install -e '.[dev]'",
}


def required() -> bool:
    """Whether every prerequisite must be present (read at each call, so a test can set it)."""
    return os.environ.get(ENV) == "1"


def skip_or_fail(reason: str) -> NoReturn:
    """Skip (also at module level) with `reason`; fail with it instead when TX_REQUIRE_ALL=1."""
    if required():
        pytest.fail(f"{reason} ({ENV}=1: a missing prerequisite fails instead of skipping)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str) -> ModuleType:
    """The imported module `name`, like pytest.importorskip, but through skip_or_fail. Called at module level, a
    failure is a collection error: none of the file's tests runs, the run fails, and the error names the package
    (without xdist pytest stops at a collection error; with it, as in CI, the other files still run)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        error = str(e)
    hint = HINTS.get(name.partition(".")[0])
    skip_or_fail(f"could not import {name!r} ({error})" + (f"; {hint}" if hint else ""))
