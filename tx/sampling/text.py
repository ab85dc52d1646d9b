"""Token ids <-> text for stop strings and answers: the model's own tokenizer, loaded at first use."""

from __future__ import annotations

from pathlib import Path


class TextCodec:
    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self._tokenizer = None

    def _tokens(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        return self._tokenizer

    def decode_text(self, tokens: list[int]) -> str:
        return self._tokens().decode(tokens, skip_special_tokens=False)

    def encode_text(self, text: str) -> list[int]:
        """`text`'s token ids as the tokenizer writes it (no special tokens added)."""
        return self._tokens().encode(text, add_special_tokens=False)
