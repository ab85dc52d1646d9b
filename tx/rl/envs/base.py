"""The env interface (`Env`, `StepOutput`, chat `Message`s) and the registry of envs by name.

Apart from `tx.rl.env` (the pool that runs envs, and lookup by name with the built-ins loaded), so the built-in
envs in this package import their interface from here, not from the module that imports them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from tx.registry import Registry

Message = dict[str, Any]


def check_messages(messages: Any, where: str) -> None:
    """Raise unless `messages` is a list of chat messages (dicts with string `role` and `content`)."""
    if not isinstance(messages, list):
        raise TypeError(f"{where} must be a list of chat messages, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"{where}[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise TypeError(f"{where}[{i}][{key!r}] must be a string, got {message.get(key)!r}")


@dataclass
class StepOutput:
    """What `Env.step` returns: new chat messages for the model, this turn's reward, and whether the episode
    ended. The trainer ignores `observations` once `done` is set (the final observation is never trained on)."""

    observations: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_messages(self.observations, "StepOutput.observations")
        # numbers.Real admits numpy scalars (rewards computed with numpy); bool is an int subclass but a
        # reward of True is almost always a slip (e.g. `done` passed in the reward slot), so it is refused.
        if isinstance(self.reward, (bool, np.bool_)) or not isinstance(self.reward, numbers.Real):
            raise TypeError(f"StepOutput.reward must be a real number, got {self.reward!r}")
        if not math.isfinite(self.reward):
            raise ValueError(f"StepOutput.reward must be finite, got {self.reward!r}")
        self.reward = float(self.reward)
        if not isinstance(self.done, (bool, np.bool_)):
            raise TypeError(f"StepOutput.done must be a bool, got {self.done!r}")
        self.done = bool(self.done)
        if not isinstance(self.metadata, dict):
            raise TypeError(f"StepOutput.metadata must be a dict, got {type(self.metadata).__name__}")


class Env:
    """Base class of environments. Subclasses implement `step`, usually `init`, and `close` if they hold
    resources. `config` is the env's section of the trainer config (`environment.skyrl_gym.<name>`)."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        # A private copy: one config mapping is shared by every env object of a run.
        self.config: dict[str, Any] = dict(config or {})

    def init(self, prompt: list[Message], extras: dict[str, Any]) -> list[Message]:
        """Start an episode from a data row's `prompt` and its other columns (`extras`); return the chat the
        model sees first. The default keeps the prompt as it is."""
        return [dict(message) for message in prompt]

    def step(self, action: str) -> StepOutput:
        """Take the model's decoded response for one turn."""
        raise NotImplementedError(f"{type(self).__name__}.step is not implemented")

    def close(self) -> None:
        """Release what the episode held. Called once per env object, after its last step."""


# ---------------------------------------------------------------------------------------------------------
# Registry

EnvT = TypeVar("EnvT", bound=type[Env])
ENVS: Registry[type[Env]] = Registry("env")


def register_env(name: str, cls: EnvT | None = None, *, replace: bool = False) -> Any:
    """Register an `Env` subclass under `name`: `@register_env("name")` on the class, or
    `register_env("name", cls)`. Registering another class under a taken name raises unless `replace=True`;
    the same class again is a no-op."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"env name must be a non-empty string, got {name!r}")

    def add(env_cls: EnvT) -> EnvT:
        if not (isinstance(env_cls, type) and issubclass(env_cls, Env)):
            raise TypeError(f"env {name!r} must be a subclass of tx.rl.Env, got {env_cls!r}")
        return ENVS.register(name, env_cls, replace=replace)

    return add(cls) if cls is not None else add
