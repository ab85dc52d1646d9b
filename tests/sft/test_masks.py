"""Loss masks from the chat template, hand-checked on a multi-turn conversation with a system prompt and
a tool call, for each train_on_what mode."""

import numpy as np
import pytest
from transformers import AutoTokenizer

from tx.sft.masks import tokenize_conversation

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "Sunny."},
]
TOOL_CALL = '\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
EXPECTED = {
    "last_assistant_message": ["Sunny.<|im_end|>"],
    "all_assistant_messages": ["Hello!<|im_end|>", TOOL_CALL, "Sunny.<|im_end|>"],
}


def _weighted_runs(tok, ex):
    """Decoded text of each maximal run of weighted target tokens."""
    runs, current = [], []
    for token, w in zip(ex.target_tokens, ex.weights):
        if w:
            current.append(int(token))
        elif current:
            runs.append(tok.decode(current)), current.clear()
    if current:
        runs.append(tok.decode(current))
    return runs


@pytest.fixture(scope="module")
def tok(tiny_dirs):
    return AutoTokenizer.from_pretrained(tiny_dirs["dense"])


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_assistant_masks(tok, mode):
    ex = tokenize_conversation(tok, CONVERSATION, mode)
    for i, run in enumerate(_weighted_runs(tok, ex)):
        print(f"{mode} run {i}: {run!r}")
    assert _weighted_runs(tok, ex) == EXPECTED[mode]
    full = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert tok.decode(list(ex.input_ids) + [int(ex.target_tokens[-1])]) == full
    np.testing.assert_array_equal(ex.input_ids[1:], ex.target_tokens[:-1])


def test_all_and_truncation(tok):
    ex = tokenize_conversation(tok, CONVERSATION, "all")
    assert ex.weights.all()
    first_turn_end = len(tok(tok.apply_chat_template(CONVERSATION[:3], tokenize=False))["input_ids"])
    short = tokenize_conversation(tok, CONVERSATION, "all_assistant_messages", max_length=first_turn_end)
    assert len(short.input_ids) == first_turn_end and _weighted_runs(tok, short) == ["Hello!<|im_end|>"]
    # the last assistant turn is cut off entirely: nothing to train on, the conversation is dropped
    assert tokenize_conversation(tok, CONVERSATION, "last_assistant_message", max_length=first_turn_end) is None
