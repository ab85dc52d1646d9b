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
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

import tx.rl.envs  # noqa: F401  (registers the built-in envs)
from tx.rl.envs.base import ENVS, Env, Message, StepOutput, check_messages, register_env

__all__ = ["Env", "EnvPool", "Message", "StepOutput", "check_messages", "env_names", "import_env_modules", "make_env",
           "register_env"]

def env_names() -> tuple[str, ...]:
    """The registered env names, built-ins included, sorted."""
    return tuple(ENVS.names())


def make_env(name: str, config: Mapping[str, Any] | None = None) -> Env:
    """A new env object of the class registered as `name`, built with `config`."""
    return ENVS.get(name)(config)


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
