"""The `gsm8k` env: one turn, reward 1.0 when the response's final answer equals the row's ground truth.

It reads `extras["reward_spec"]["ground_truth"]` (SkyRL's gsm8k data rows). The answer is found by SkyRL's
strict rule: the first `#### <number>` in the response. tx extends it: a response without one may give its
answer as the last `\\boxed{...}` (the convention of tinker-cookbook's math envs and of most instruct
models). Both sides are compared as strings after removing commas, dollar signs and surrounding whitespace;
there is no numeric normalisation ("72.0" is not "72"), as in SkyRL, so rewards match SkyRL's for every
response SkyRL can grade. Like SkyRL's regex, `#### 72.` captures "72." and scores 0.
"""

from __future__ import annotations

import numbers
import re
from typing import Any

from tx.rl.envs.base import Env, Message, StepOutput, register_env

# SkyRL's strict pattern, verbatim in meaning: an optional minus, then digits, dots and commas.
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_BOXED = "\\boxed{"


def normalize(answer: str) -> str:
    """Drop thousands separators and currency signs (plain and LaTeX-escaped), then surrounding whitespace."""
    return answer.replace(",", "").replace("\\$", "").replace("$", "").strip()


def _last_boxed(text: str) -> str | None:
    # Scan `\boxed{` occurrences from the last one back and return the content of the first one whose
    # braces close; a truncated final box falls back to an earlier complete one.
    start = text.rfind(_BOXED)
    while start != -1:
        depth, i = 1, start + len(_BOXED)
        while i < len(text):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len(_BOXED) : i]
            i += 1
        start = text.rfind(_BOXED, 0, start)
    return None


def extract_answer(text: str) -> str | None:
    """The normalised final answer of a response: the first `#### <number>`, else the last balanced
    `\\boxed{...}`; None when there is neither (or the box is empty)."""
    match = _STRICT.search(text)
    if match is not None:
        return normalize(match.group(1))
    boxed = _last_boxed(text)
    if boxed is None:
        return None
    return normalize(boxed) or None


def gsm8k_reward(text: str, ground_truth: str | int) -> float:
    """1.0 when `extract_answer(text)` equals the normalised ground truth (exact string match), else 0.0."""
    answer = extract_answer(text)
    return float(answer is not None and answer == normalize(_ground_truth_str(ground_truth)))


def _ground_truth_str(value: Any) -> str:
    # Integers are accepted because parquet/pandas may store the column as int64; floats are not, since
    # str(72.0) == "72.0" would silently never match an integer answer.
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(int(value))
    raise ValueError(f"reward_spec.ground_truth must be a string (or an int), got {value!r}")


@register_env("gsm8k")
class GSM8kEnv(Env):
    """Single-turn math grading; `metadata["extracted"]` is the answer found (None if none)."""

    ground_truth: str | None = None

    def init(self, prompt: list[Message], extras: dict[str, Any]) -> list[Message]:
        reward_spec = extras.get("reward_spec")
        if not isinstance(reward_spec, dict) or reward_spec.get("ground_truth") is None:
            raise ValueError(f"gsm8k env needs extras['reward_spec']['ground_truth'] (reward_spec.ground_truth); "
                             f"got reward_spec={reward_spec!r}")
        self.ground_truth = normalize(_ground_truth_str(reward_spec["ground_truth"]))
        return super().init(prompt, extras)

    def step(self, action: str) -> StepOutput:
        if self.ground_truth is None:
            raise RuntimeError("GSM8kEnv.step called before init")
        answer = extract_answer(action)
        reward = float(answer is not None and answer == self.ground_truth)
        return StepOutput(observations=[], reward=reward, done=True, metadata={"extracted": answer})
