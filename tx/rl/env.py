"""Environments for RL: the `Env` interface, a registry by name, and `EnvPool` to run many at once.

The interface is SkyRL-Gym's text env reduced to what the trainer uses, so porting an env is mostly
renaming. One env object serves one trajectory (episode):

    import tx.rl

    @tx.rl.register_env("my_env")
    class MyEnv(tx.rl.Env):
        def init(self, prompt: list[dict], extras: dict) -> list[dict]:
            self.answer = extras["reward_spec"]["ground_truth"]
            return prompt                       # the chat the model sees (may be rewritten)

        def step(self, action: str) -> tx.rl.StepOutput:
            return tx.rl.StepOutput(reward=float(self.answer in action), done=True)

Differences from SkyRL-Gym: `extras` (the data row's other columns) arrive in `init` instead of the
constructor, which only takes the env config (`environment.skyrl_gym.<env_class>`); `init` returns the chat
alone (no info tuple); `StepOutput` is a validated dataclass, not a TypedDict, and has no
`postprocessed_action` (rewriting the action breaks token-in/token-out training).

The registry is per process: envs defined outside tx register when their module is imported, which
`import_env_modules` does for the module names a config lists.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

import numpy as np

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
_REGISTRY: dict[str, type[Env]] = {}


def register_env(name: str, cls: EnvT | None = None, *, replace: bool = False) -> Any:
    """Register an `Env` subclass under `name`: `@register_env("name")` on the class, or
    `register_env("name", cls)`. Registering another class under a taken name raises unless `replace=True`;
    the same class again is a no-op."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"env name must be a non-empty string, got {name!r}")

    def add(env_cls: EnvT) -> EnvT:
        if not (isinstance(env_cls, type) and issubclass(env_cls, Env)):
            raise TypeError(f"env {name!r} must be a subclass of tx.rl.Env, got {env_cls!r}")
        if name in _REGISTRY and _REGISTRY[name] is not env_cls and not replace:
            raise ValueError(
                f"env {name!r} is already registered to {_REGISTRY[name].__qualname__} (pass replace=True to override)"
            )
        _REGISTRY[name] = env_cls
        return env_cls

    return add(cls) if cls is not None else add


def _load_builtin_envs() -> None:
    # Imported here, not at module top: the built-in env modules import this one.
    importlib.import_module("tx.rl.envs")


def env_names() -> tuple[str, ...]:
    """The registered env names, built-ins included, sorted."""
    _load_builtin_envs()
    return tuple(sorted(_REGISTRY))


def make_env(name: str, config: Mapping[str, Any] | None = None) -> Env:
    """A new env object of the class registered as `name`, built with `config`."""
    _load_builtin_envs()
    if name not in _REGISTRY:
        raise KeyError(f"unknown env {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](config)


def import_env_modules(modules: Sequence[str]) -> None:
    """Import each module by its dotted name so that its `@register_env` decorators run."""
    if isinstance(modules, str):
        raise TypeError(f"import_env_modules takes a list of module names, got the string {modules!r}")
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # a syntax or registration error in the module is as fatal as a missing one
            raise ImportError(f"could not import env module {module!r}: {type(exc).__name__}: {exc}") from exc


# ---------------------------------------------------------------------------------------------------------
# Running many envs at once

def _describe(env: Env, method: str, exc: BaseException) -> str:
    return f"{type(env).__name__}.{method} raised {type(exc).__name__}: {exc}"


class EnvPool:
    """Runs `init`/`step`/`close` of many envs on a thread pool (SkyRL's `max_env_workers`; 0 runs them
    inline), so envs that wait on I/O or sandboxes do not wait on each other.

    An exception in one env stays with its episode: `map_step` returns `StepOutput(reward=0.0, done=True,
    metadata={"error": "<Env>.step raised <Exc>: <msg>"})` for it, which the trainer logs. A failed `init`
    yields the prompt unchanged and the error is reported by that env's next `map_step` (without calling its
    `step`), so every episode still goes through the same init -> step sequence."""

    _INIT_ERROR = "_tx_env_pool_init_error"

    def __init__(self, max_workers: int = 32) -> None:
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 0:
            raise ValueError(f"max_env_workers must be an int >= 0, got {max_workers!r}")
        self.max_workers = max_workers
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="tx-env") if max_workers else None
        self._closed = False

    def _map(self, fn: Callable[..., Any], *columns: Sequence[Any]) -> list[Any]:
        lengths = {len(column) for column in columns}
        if len(lengths) > 1:
            raise ValueError(f"EnvPool got lists of different lengths: {[len(c) for c in columns]}")
        if self._closed:
            raise RuntimeError("EnvPool is closed")
        if self._executor is None:
            return [fn(*args) for args in zip(*columns)]
        return list(self._executor.map(fn, *columns))  # map keeps the input order

    def _init_one(self, env: Env, prompt: list[Message], extras: dict[str, Any]) -> list[Message]:
        try:
            chat = env.init(prompt, extras)
            check_messages(chat, f"{type(env).__name__}.init() result")
            setattr(env, self._INIT_ERROR, None)
            return chat
        except Exception as exc:  # noqa: BLE001 - any env bug stays with its episode
            setattr(env, self._INIT_ERROR, _describe(env, "init", exc))
            return [dict(message) for message in prompt]

    def _step_one(self, env: Env, action: str) -> StepOutput:
        init_error = getattr(env, self._INIT_ERROR, None)
        if init_error is not None:
            return StepOutput(reward=0.0, done=True, metadata={"error": init_error})
        try:
            out = env.step(action)
            if not isinstance(out, StepOutput):
                raise TypeError(f"returned {type(out).__name__}, expected tx.rl.StepOutput")
            return out
        except Exception as exc:  # noqa: BLE001 - any env bug stays with its episode
            return StepOutput(reward=0.0, done=True, metadata={"error": _describe(env, "step", exc)})

    @staticmethod
    def _close_one(env: Env) -> str | None:
        try:
            env.close()
            return None
        except Exception as exc:  # noqa: BLE001 - a failed cleanup is reported, not fatal
            return _describe(env, "close", exc)

    def map_init(
        self, envs: Sequence[Env], prompts: Sequence[list[Message]], extras: Sequence[dict[str, Any]]
    ) -> list[list[Message]]:
        """`env.init(prompt, extras)` for each triple, in order."""
        return self._map(self._init_one, envs, prompts, extras)

    def map_step(self, envs: Sequence[Env], actions: Sequence[str]) -> list[StepOutput]:
        """`env.step(action)` for each pair, in order; a raising env gives an error `StepOutput`."""
        return self._map(self._step_one, envs, actions)

    def map_close(self, envs: Sequence[Env]) -> list[str | None]:
        """`env.close()` for each env; returns None per env, or the error message of one that raised."""
        return self._map(self._close_one, envs)

    def close(self) -> None:
        """Stop the worker threads (waits for running calls)."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
