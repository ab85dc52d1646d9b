"""Test helpers: reference log-probs from transformers, batches, PEFT weight extraction."""

from __future__ import annotations

import numpy as np
import torch


def random_batch(seed: int, lengths: list[int], vocab: int, pad_to: int | None = None):
    """Right-padded ids, mask and next-token targets for sequences of the given lengths."""
    rng = np.random.default_rng(seed)
    t = pad_to or max(lengths)
    ids = np.zeros((len(lengths), t), np.int32)
    mask = np.zeros((len(lengths), t), np.int32)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(0, vocab, n)
        mask[i, :n] = 1
    targets = np.roll(ids, -1, axis=1) * mask
    return ids, mask, targets


def hf_logprobs(model, ids: np.ndarray, mask: np.ndarray, targets: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, torch.tensor(targets, dtype=torch.long)[..., None])[..., 0].numpy()


def peft_weights(peft_model) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{hf module name: (A [r, in], B [out, r])} of a PEFT model's default adapter."""
    out = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            out[name.removeprefix("base_model.model.")] = (
                module.lora_A["default"].weight.detach().numpy().copy(),
                module.lora_B["default"].weight.detach().numpy().copy(),
            )
    return out
