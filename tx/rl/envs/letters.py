"""The `letters` env: a reward a tiny random model can learn offline in minutes.

Why it exists: the trainer needs an end-to-end check (and `examples/rl_tiny.yaml` a demo) that runs without
a real model, a data download or a network. The reward is the fraction of the response's characters
(surrounding whitespace stripped) that belong to a charset, by default ASCII letters and space. It is dense
and continuous: a random byte-level model already scores around 0.2 (53 of 256 bytes), and responses
differ, so GRPO groups have reward variance from the first step and the policy can climb towards 1.0 by
shifting probability onto the charset's tokens.

Options: `charset` in the env config (`environment.skyrl_gym.letters.charset`), overridable per data row by
`extras["charset"]`; one of `CHARSETS`.
"""

from __future__ import annotations

import string
from typing import Any

from tx.rl.envs.base import Env, Message, StepOutput, register_env

CHARSETS: dict[str, frozenset[str]] = {
    "letters": frozenset(string.ascii_letters + " "),
    "digits": frozenset(string.digits + " "),
}


def _charset(name: Any) -> frozenset[str]:
    if name not in CHARSETS:
        raise ValueError(f"letters env: charset must be one of {sorted(CHARSETS)}, got {name!r}")
    return CHARSETS[name]


def letters_reward(text: str, charset: str = "letters") -> float:
    """The fraction of `text.strip()`'s characters in `CHARSETS[charset]`; 0.0 for an empty response."""
    allowed = _charset(charset)
    text = text.strip()
    if not text:
        return 0.0
    return sum(ch in allowed for ch in text) / len(text)


@register_env("letters")
class LettersEnv(Env):
    """Single turn; reward `letters_reward(action, charset)`."""

    charset: str = "letters"

    def init(self, prompt: list[Message], extras: dict[str, Any]) -> list[Message]:
        charset = extras.get("charset")
        if charset is None:
            charset = self.config.get("charset", "letters")
        _charset(charset)  # fail at init, naming the bad value, rather than at the first step
        self.charset = charset
        return super().init(prompt, extras)

    def step(self, action: str) -> StepOutput:
        reward = letters_reward(action, self.charset)
        return StepOutput(observations=[], reward=reward, done=True, metadata={"charset": self.charset})
