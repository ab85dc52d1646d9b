"""A small byte-level BPE tokenizer with Qwen-style special tokens and chat template, built offline."""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# A Qwen-style ChatML template: optional tools block in the system turn, assistant tool calls as JSON
# inside <tool_call> tags, tool results wrapped as a user turn in <tool_response> tags.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- 'You may call these tools:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' + (fn.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. A language model predicts the next token of a text.
Fine-tuning adapts a pretrained model to a task; low-rank adapters train a small update to each weight.
User: What is the capital of France? Assistant: The capital of France is Paris.
User: Add two and three. Assistant: Two plus three is five. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026.
Tools return results as JSON: {"name": "get_weather", "arguments": {"city": "Berlin"}}.
Reinforcement learning samples answers, scores them, and trains on the advantage of each answer.
Hello, world! How are you today? I am fine, thank you. Please write a short poem about the sea.
def add(a, b):\n    return a + b\nprint(add(2, 3))
"""


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> int:
    """Train the BPE on the bundled corpus, save `tokenizer.json` + `tokenizer_config.json`; return its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )
    fast.save_pretrained(str(out_dir))
    return len(fast)
