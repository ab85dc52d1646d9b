"""`python -m tx.run --base-model <a Llama 3 checkpoint directory>` serves it to the official SDK: the README's
example client (examples/tinker_client.py, unmodified) trains a LoRA adapter on it, saves it and samples from it;
the capabilities name its family and the cookbook's renderer for it.
The checkpoint is written by transformers' own `save_pretrained` (Llama 3.1 RoPE scaling), with tx's tiny
tokenizer beside it so the client can tokenize."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.api.server_proc import API_KEY, Server
from tx.models.tiny_tokenizer import SPECIAL_TOKENS, build_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def llama_dir(path: Path) -> Path:
    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_parameters=rope, tie_word_embeddings=True, initializer_range=0.1,
                         eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
                         pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"), bos_token_id=None)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    assert build_tokenizer(path) <= 512
    return path


def test_the_readme_client_trains_and_samples_a_llama(tmp_path):
    model = llama_dir(tmp_path / "llama")
    server = Server(tmp_path / "data", "--max-seq-len", "1024", base_model=str(model))
    try:
        caps = server.get("/api/v1/get_server_capabilities").json()
        proc = subprocess.run([sys.executable, "examples/tinker_client.py", "--base-url", server.url, "--api-key",
                               API_KEY], cwd=ROOT, capture_output=True, text=True, timeout=900)
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-3000:] + server.log()[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    steps = [x for x in lines if "step" in x]
    assert [x["step"] for x in steps] == list(range(10))
    assert steps[-1]["loss_per_token"] < steps[0]["loss_per_token"], steps
    assert lines[-1]["saved"].startswith("tinker://") and len(lines[-1]["samples"]) == 2
    assert [(m["model_name"], m["arch"], m["family"], m["renderer_name"]) for m in caps["supported_models"]] == [
        (str(model), "LlamaForCausalLM", "llama", "llama3")], caps
