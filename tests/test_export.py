"""`python -m tx.export`: base + adapter merged, loadable by transformers, equal to tx with the adapter."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.checkpoints.test_sampler import PROMPT, _prompt_logprobs, _trained
from tests.helpers import hf_logprobs


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_merged_export_matches_tx(tiny_dirs, tmp_path, name):
    backend = _trained(tiny_dirs, name)
    backend.save_sampler_checkpoint(tmp_path / "s.tar.gz", "a")
    cmd = [sys.executable, "-m", "tx.export", "--base-model", tiny_dirs[name], "--adapter", str(tmp_path / "s.tar.gz"),
           "--out", str(tmp_path / "merged")]
    summary = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    assert summary["merged_weights"] > 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    ids = np.array([PROMPT])
    want = hf_logprobs(merged, ids, np.ones_like(ids), np.roll(ids, -1, axis=1))[0, :-1]
    assert np.abs(_prompt_logprobs(backend, model_id="a") - want).max() <= 1e-4


def test_tied_lm_head_adapter_refuses_to_merge(tiny_dirs, tmp_path):
    backend = _trained(tiny_dirs, "dense_tied_mha", steps=1)
    backend.save_sampler_checkpoint(tmp_path / "s.tar.gz", "a")
    from tx.export import merge

    with pytest.raises(ValueError, match="tied embeddings"):
        merge(tiny_dirs["dense_tied_mha"], str(tmp_path / "s.tar.gz"), tmp_path / "out")
