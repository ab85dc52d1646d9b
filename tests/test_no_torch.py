"""tx runs without PyTorch (a runtime install has none): it starts without transformers' "PyTorch was not
found" line. Checked in a subprocess whose import system cannot see torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LINE = "PyTorch was not found"
HIDE_TORCH = """
import sys
class _Hide:
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return None
        return self.inner.find_spec(name, path, target)
    def __getattr__(self, attr):  # find_distributions etc. (package metadata) as before
        return getattr(self.inner, attr)
sys.meta_path[:] = [_Hide(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
"""


def _run(code: str) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    for quiet in ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "TRANSFORMERS_VERBOSITY"):  # tests/conftest.py sets one
        env.pop(quiet, None)
    done = subprocess.run([sys.executable, "-c", HIDE_TORCH + code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_transformers_without_torch_is_quiet_under_tx(tmp_path):
    # the control: with torch hidden, transformers alone prints the line (so torch really is hidden)
    assert LINE in _run("import transformers; transformers.AutoTokenizer")
    # tx first (as `python -m tx.run` and every tx entry point do), then what tx uses from transformers
    out = _run("import tx, transformers; from transformers import AutoTokenizer, PreTrainedTokenizerFast\n"
               f"from tx.models.tiny import main; main([{str(tmp_path / 'tiny')!r}, '--num-layers', '1'])\n"
               "assert 'torch' not in sys.modules and 'transformers' in sys.modules")
    assert LINE not in out, out
    assert (tmp_path / "tiny" / "tokenizer.json").exists()
