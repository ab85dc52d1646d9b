"""Token weights from the tokenizer's chat template: which tokens of a conversation a model trains on.

`train_on_what`:
- `last_assistant_message`: the content of the final assistant turn and its end-of-turn token;
- `all_assistant_messages`: the same for every assistant turn (tool calls included, they are the
  assistant's content);
- `all`: every token of the rendered conversation.

How: the conversation is rendered once and tokenised with character offsets. An assistant turn k spans
from the end of `render(messages[:k], add_generation_prompt=True)` (everything up to and including the
assistant header) to the end of its end-of-turn token inside `render(messages[:k + 1])`. Both renders must
be prefixes of the full render; a template that rewrites earlier turns (e.g. dropping their reasoning)
is reported instead of silently producing wrong masks.

Truncation (`max_length`): the rendered token sequence is cut on the right to `max_length + 1` tokens
(inputs are tokens[:-1], targets tokens[1:]); a conversation left with no weighted target is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

TrainOnWhat = Literal["last_assistant_message", "all_assistant_messages", "all"]


@dataclass
class Example:
    input_ids: np.ndarray  # int32 [n]
    target_tokens: np.ndarray  # int32 [n]
    weights: np.ndarray  # float32 [n]: weight of predicting target_tokens[i]


def _render(tokenizer, messages: list[dict], tools, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages: list[dict], tools: list[dict] | None, which: TrainOnWhat) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and the character spans [start, end) that carry weight."""
    full = _render(tokenizer, messages, tools, False)
    if which == "all":
        return full, [(0, len(full))]
    turns = [k for k, m in enumerate(messages) if m.get("role") == "assistant"]
    if which == "last_assistant_message":
        turns = turns[-1:]
    eot = tokenizer.eos_token
    spans = []
    for k in turns:
        before = _render(tokenizer, messages[:k], tools, True)
        through = _render(tokenizer, messages[: k + 1], tools, False)
        if not (full.startswith(before) and full.startswith(through)):
            raise ValueError(f"the chat template renders message {k} differently in context (it is not prefix-stable); "
                             "masks cannot be derived from it")
        end = through.rfind(eot, len(before)) if eot else -1
        spans.append((len(before), end + len(eot) if end >= 0 else len(through)))
    return full, spans


def tokenize_conversation(
    tokenizer,
    messages: list[dict[str, Any]],
    train_on_what: TrainOnWhat = "last_assistant_message",
    tools: list[dict] | None = None,
    max_length: int | None = None,
) -> Example | None:
    """Inputs, next-token targets and weights for one conversation; None if nothing is left to train on."""
    text, spans = assistant_spans(tokenizer, messages, tools, train_on_what)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], np.int32)
    offsets = np.asarray(enc["offset_mapping"], np.int64).reshape(-1, 2)
    weight = np.zeros(len(ids), np.float32)
    for start, end in spans:
        weight[(offsets[:, 0] >= start) & (offsets[:, 1] <= end) & (offsets[:, 1] > offsets[:, 0])] = 1.0
    if max_length is not None:
        ids, weight = ids[: max_length + 1], weight[: max_length + 1]
    if len(ids) < 2 or not weight[1:].any():
        return None
    return Example(input_ids=ids[:-1], target_tokens=ids[1:], weights=weight[1:])
