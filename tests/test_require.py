"""tests/require.py: a missing prerequisite skips, and fails when TX_REQUIRE_ALL=1 (as .ci/run sets), also at
module level (a test file that cannot import what it needs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.require import ENV, require_module, skip_or_fail

ROOT = Path(__file__).parents[1]
MISSING = "tx_no_such_module_for_require_test"


def test_present_module_is_returned(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    assert require_module("json").dumps([1]) == "[1]"


@pytest.mark.parametrize("required", [False, True])
def test_missing_prerequisite_skips_or_fails(monkeypatch, required):
    if required:
        monkeypatch.setenv(ENV, "1")
    else:
        monkeypatch.delenv(ENV, raising=False)
    expected = pytest.fail.Exception if required else pytest.skip.Exception
    with pytest.raises(expected, match=MISSING):
        require_module(MISSING)
    with pytest.raises(expected, match="no server here"):
        skip_or_fail("no server here")


@pytest.mark.parametrize("required", [False, True])
def test_module_level_require_in_a_pytest_run(tmp_path, required):
    """A test file requiring a missing module: skipped without the variable, a collection error with it."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's config (no xdist, no conftest)
    (tmp_path / "test_needs_missing.py").write_text(
        f"from tests.require import require_module\nrequire_module({MISSING!r})\n\ndef test_x():\n    pass\n"
    )
    env = {k: v for k, v in os.environ.items() if k != ENV} | {"PYTHONPATH": str(ROOT)}
    if required:
        env[ENV] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    out = proc.stdout + proc.stderr
    if required:
        assert proc.returncode != 0 and "error" in out and MISSING in out and ENV in out, out
    else:
        assert proc.returncode in (0, 5) and "1 skipped" in out and MISSING in out, out  # 5: nothing ran
