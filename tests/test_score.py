"""`python -m tx.score` end to end: JSON lines whose log-probs equal transformers'."""

import json
import subprocess
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_score_cli_matches_transformers(tiny_dirs):
    texts = ["Hello, world!", "The capital of France is Paris."]
    cmd = [sys.executable, "-m", "tx.score", tiny_dirs["moe"], "--text", texts[0], "--text", texts[1], "--chunk-size", "4"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()
    rows = [json.loads(line) for line in out]
    assert rows[-1]["summary"] and rows[-1]["texts"] == 2
    tok = AutoTokenizer.from_pretrained(tiny_dirs["moe"])
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["moe"], dtype=torch.float32)
    for row, text in zip(rows, texts):
        ids = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():
            lp = torch.log_softmax(hf(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0].numpy()
        assert row["tokens"] == ids.shape[1]
        np.testing.assert_allclose(row["token_logprobs"], lp, atol=1e-4)
        np.testing.assert_allclose(row["perplexity"], np.exp(-lp.mean()), rtol=1e-4)
