"""The tiny checkpoint CLI: files, sharded index, tokenizer with Qwen special tokens and chat template."""

import json
import subprocess
import sys

from transformers import AutoTokenizer

from tx.models.config import ModelConfig
from tx.models.safetensors_io import SafetensorsDir


def test_cli_writes_sharded_moe_checkpoint(tmp_path):
    out = tmp_path / "m"
    cmd = [sys.executable, "-m", "tx.models.tiny", str(out), "--moe", "--shards", "2", "--num-layers", "3",
           "--hidden-size", "32", "--num-experts", "4", "--mlp-only-layers", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["architecture"] == "Qwen3MoeForCausalLM"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    files = SafetensorsDir(out)
    assert set(files.keys()) == set(index["weight_map"])
    assert sum(files.get(k).size for k in files.keys()) == summary["params"]
    assert "model.layers.1.mlp.gate_proj.weight" in files and "model.layers.2.mlp.experts.3.down_proj.weight" in files
    cfg = ModelConfig.from_dir(out)
    assert (cfg.hidden_size, cfg.num_experts, cfg.mlp_only_layers) == (32, 4, (1,))


def test_cli_rejects_bad_values(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tx.models.tiny", str(tmp_path), "--hidden-size", "-3"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "hidden_size" in result.stderr


def test_tokenizer_chat_template(tiny_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_dirs["dense"])
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [0, 1, 2] and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nSunny.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    encoded = tok(text)["input_ids"]
    assert tok.decode(encoded) == text and encoded.count(2) == 5  # <|im_end|> is one token
