"""The `guess` env: a multi-turn game, and the example of an env that talks back.

The model guesses an integer `extras["target"]` in [1, `extras["high"]` (default 10)]. Each step reads the
last integer of the response: the target ends the episode with reward 1.0; otherwise the env answers
"higher", "lower" or asks for a number, until `max_turns` guesses (per row `extras["max_turns"]`, else the
env config's `max_turns`, else 3) have been spent, which ends the episode with reward 0.0.
"""

from __future__ import annotations

import numbers
import re
from typing import Any

from tx.rl.envs.base import Env, Message, StepOutput, register_env

_INTEGER = re.compile(r"-?\d+")
NO_NUMBER = "no number found; answer with a number"


def _int_option(name: str, value: Any, low: int) -> int:
    # numbers.Integral admits numpy ints, which is what integer columns of a parquet file arrive as.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"guess env: {name} must be an integer >= {low}, got {value!r}")
    return int(value)


def last_integer(text: str) -> int | None:
    """The last integer written in `text` (a leading minus included), or None."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


@register_env("guess")
class GuessEnv(Env):
    """`metadata["turn"]` is the number of guesses made so far, this one included."""

    target: int | None = None

    def init(self, prompt: list[Message], extras: dict[str, Any]) -> list[Message]:
        if "target" not in extras:
            raise ValueError("guess env needs extras['target'] (the integer to guess)")
        high = _int_option("high", extras.get("high", 10), 1)
        target = _int_option("target", extras["target"], 1)
        if target > high:
            raise ValueError(f"guess env: target must be in [1, high={high}], got {target}")
        max_turns = extras.get("max_turns")
        if max_turns is None:
            max_turns = self.config.get("max_turns", 3)
        self.max_turns = _int_option("max_turns", max_turns, 1)
        self.target, self.turn = target, 0
        return super().init(prompt, extras)

    def step(self, action: str) -> StepOutput:
        if self.target is None:
            raise RuntimeError("GuessEnv.step called before init")
        self.turn += 1
        meta = {"turn": self.turn}
        guess = last_integer(action)
        if guess == self.target:
            return StepOutput(observations=[], reward=1.0, done=True, metadata=meta)
        if self.turn >= self.max_turns:
            return StepOutput(observations=[], reward=0.0, done=True, metadata=meta)
        hint = NO_NUMBER if guess is None else ("higher" if guess < self.target else "lower")
        return StepOutput(observations=[{"role": "user", "content": hint}], reward=0.0, done=False, metadata=meta)
