"""The env layer: Env/StepOutput contract, the registry, the built-in envs and EnvPool.

Expected values are worked out by hand in the comments, not taken from the code's own output.
"""

import math
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pytest

from tx.rl import env as env_mod
from tx.rl.env import (
    Env,
    EnvPool,
    StepOutput,
    env_names,
    import_env_modules,
    make_env,
    register_env,
)
from tx.rl.envs.gsm8k import extract_answer, gsm8k_reward
from tx.rl.envs.letters import letters_reward

PROMPT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def registry():
    """The registry as it was before the test is put back after it, so tests can register freely."""
    saved = env_mod.ENVS.snapshot()
    yield
    env_mod.ENVS.restore(saved)


class Echo(Env):
    def step(self, action):
        return StepOutput(reward=float(len(action)), metadata={"action": action})


# ---------------------------------------------------------------------------------------------------------
# Env and StepOutput


def test_env_base_defaults():
    config = {"k": 1}
    env = Env(config)
    config["k"] = 2
    assert env.config == {"k": 1}  # a copy, not the shared mapping
    assert Env().config == {}
    chat = env.init(PROMPT, {})
    assert chat == PROMPT and chat is not PROMPT and chat[0] is not PROMPT[0]
    with pytest.raises(NotImplementedError, match="Echo2.step"):
        type("Echo2", (Env,), {})().step("x")
    assert env.close() is None


def test_step_output_defaults_and_coercion():
    out = StepOutput()
    assert (out.observations, out.reward, out.done, out.metadata) == ([], 0.0, True, {})
    assert StepOutput().observations is not out.observations  # no shared mutable default
    out = StepOutput(reward=np.float32(0.5), done=np.bool_(False))
    assert type(out.reward) is float and out.reward == 0.5 and out.done is False
    assert StepOutput(reward=1).reward == 1.0


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf, np.float64("nan")])
def test_step_output_rejects_non_finite_reward(reward):
    with pytest.raises(ValueError, match="StepOutput.reward"):
        StepOutput(reward=reward)


@pytest.mark.parametrize("reward", ["1.0", None, True, [1.0]])
def test_step_output_rejects_non_number_reward(reward):
    with pytest.raises(TypeError, match="StepOutput.reward"):
        StepOutput(reward=reward)


@pytest.mark.parametrize(
    "observations",
    [
        {"role": "user", "content": "x"},  # a message, not a list of them
        ["higher"],
        [{"role": "user"}],
        [{"role": "user", "content": 3}],
        [{"content": "x"}],
    ],
)
def test_step_output_rejects_bad_observations(observations):
    with pytest.raises(TypeError, match="StepOutput.observations"):
        StepOutput(observations=observations)


def test_step_output_rejects_bad_done_and_metadata():
    with pytest.raises(TypeError, match="StepOutput.done"):
        StepOutput(done=1)
    with pytest.raises(TypeError, match="StepOutput.metadata"):
        StepOutput(metadata=None)


# ---------------------------------------------------------------------------------------------------------
# Registry


def test_builtins_registered():
    assert {"gsm8k", "letters", "guess"} <= set(env_names())
    assert env_names() == tuple(sorted(env_names()))


def test_register_make_duplicate_replace(registry):
    @register_env("echo_test")
    class EchoA(Echo):
        pass

    env = make_env("echo_test", {"a": 1})
    assert type(env) is EchoA and env.config == {"a": 1}
    assert "echo_test" in env_names()

    class EchoB(Echo):
        pass

    with pytest.raises(ValueError, match="echo_test.*already registered"):
        register_env("echo_test", EchoB)
    assert type(make_env("echo_test")) is EchoA  # the failed registration changed nothing
    assert register_env("echo_test", EchoB, replace=True) is EchoB
    assert type(make_env("echo_test")) is EchoB


def test_register_rejects_non_env(registry):
    with pytest.raises(TypeError, match="not_env"):
        register_env("not_env", object)
    with pytest.raises(TypeError, match="not_env"):
        register_env("not_env")(lambda action: None)
    with pytest.raises(TypeError):
        register_env("not_env", Echo())  # an instance, not a class
    assert "not_env" not in env_names()


def test_make_unknown_lists_registered(registry):
    with pytest.raises(KeyError) as info:
        make_env("no_such_env")
    message = str(info.value)
    assert "no_such_env" in message and "gsm8k" in message and "guess" in message and "letters" in message


def test_make_env_has_the_builtins_without_importing_them():
    # a fresh interpreter that imports only tx.rl.env: the built-in envs are registered by that import
    code = "from tx.rl.env import make_env, env_names; print(type(make_env('gsm8k')).__name__, env_names())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split(" ", 1) == ["GSM8kEnv", "('gsm8k', 'guess', 'letters')\n"], out


def test_import_env_modules_user_module(registry, tmp_path, monkeypatch):
    module = f"user_envs_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            """
            from tx.rl.env import Env, StepOutput, register_env

            @register_env("user_shout")
            class Shout(Env):
                def init(self, prompt, extras):
                    self.suffix = extras.get("suffix", "!")
                    return [{"role": "system", "content": "shout"}, *prompt]

                def step(self, action):
                    return StepOutput(reward=float(action.endswith(self.suffix)), metadata=dict(self.config))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    assert "user_shout" not in env_names()
    import_env_modules([module])
    env = make_env("user_shout", {"loud": True})
    assert env.init(PROMPT, {"suffix": "?"})[0] == {"role": "system", "content": "shout"}
    assert env.step("why?") == StepOutput(reward=1.0, metadata={"loud": True})
    monkeypatch.delitem(sys.modules, module)


def test_import_env_modules_errors(tmp_path, monkeypatch):
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        import_env_modules(["no_such_module_xyz"])
    module = f"broken_envs_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("raise RuntimeError('bad env module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=f"{module}.*bad env module"):
        import_env_modules([module])
    with pytest.raises(TypeError):
        import_env_modules("tx.rl.envs")  # a string, not a list


# ---------------------------------------------------------------------------------------------------------
# gsm8k


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the total is 72.\n#### 72", "72"),
        ("#### 12\nwait, no\n#### 72", "12"),  # SkyRL's strict rule: the first #### wins
        ("#### -5", "-5"),
        ("#### 1,234,567", "1234567"),
        ("#### 3.5", "3.5"),
        ("#### 72.", "72."),  # the regex keeps a trailing dot, as SkyRL's does
        ("#### $72", None),  # SkyRL's number pattern has no '$', so this is no answer
        ("#### seventy-two", None),
        ("The answer is \\boxed{72}.", "72"),
        ("\\boxed{1,000}", "1000"),
        ("\\boxed{\\$1,000}", "1000"),
        ("\\boxed{$18}", "18"),
        ("\\boxed{ 72 }", "72"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{\\frac{\\sqrt{2}}{2}} end", "\\frac{\\sqrt{2}}{2}"),
        ("first \\boxed{3}, then \\boxed{4}", "4"),  # the last box wins
        ("\\boxed{3} then \\boxed{4", "3"),  # an unclosed last box falls back to the complete one
        ("\\boxed{5}\n#### 6", "6"),  # #### is preferred over a box wherever each appears
        ("#### 6\n\\boxed{5}", "6"),
        ("\\boxed{}", None),
        ("no answer here, maybe 72", None),
        ("", None),
    ],
)
def test_gsm8k_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, ground_truth, reward",
    [
        ("#### 72", "72", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### 1234", "1,234", 1.0),  # the ground truth is normalised the same way
        ("\\boxed{\\$1,234}", " 1234 ", 1.0),
        ("#### 72", 72, 1.0),
        ("#### 72", np.int64(72), 1.0),  # integer columns arrive as numpy ints
        ("#### 72.0", "72", 0.0),  # exact strings, no numeric normalisation (SkyRL's rule)
        ("#### 72", "72.00", 0.0),
        ("#### 71", "72", 0.0),
        ("#### -72", "72", 0.0),
        ("I think it is 72", "72", 0.0),
        ("#### 12\n#### 72", "72", 0.0),
    ],
)
def test_gsm8k_reward(text, ground_truth, reward):
    assert gsm8k_reward(text, ground_truth) == reward


def test_gsm8k_env_episode():
    env = make_env("gsm8k")
    row = {"data_source": "openai/gsm8k", "reward_spec": {"method": "rule", "ground_truth": "72"}}
    assert env.init(PROMPT, row) == PROMPT
    assert env.step("48 + 24 = 72\n#### 72") == StepOutput([], 1.0, True, {"extracted": "72"})
    env = make_env("gsm8k")
    env.init(PROMPT, row)
    assert env.step("I don't know") == StepOutput([], 0.0, True, {"extracted": None})


@pytest.mark.parametrize("extras", [{}, {"reward_spec": {}}, {"reward_spec": {"ground_truth": None}},
                                    {"reward_spec": "72"}, {"reward_spec": {"ground_truth": 72.0}}])
def test_gsm8k_env_needs_ground_truth(extras):
    with pytest.raises(ValueError, match="reward_spec.ground_truth"):
        make_env("gsm8k").init(PROMPT, extras)


# ---------------------------------------------------------------------------------------------------------
# letters


@pytest.mark.parametrize(
    "text, charset, reward",
    [
        ("Hello world", "letters", 1.0),
        ("  Hello world \n", "letters", 1.0),  # surrounding whitespace is not counted
        ("ab1!", "letters", 0.5),  # a, b of 4
        ("a1 2", "letters", 0.5),  # a, ' ' of 4
        ("a1 2", "digits", 0.75),  # 1, ' ', 2 of 4
        ("héllo", "letters", 0.8),  # é is not ASCII: 4 of 5
        ("12345", "letters", 0.0),
        ("12345", "digits", 1.0),
        ("x=1;", "digits", 0.25),
        ("", "letters", 0.0),
        ("   \n", "digits", 0.0),
    ],
)
def test_letters_reward(text, charset, reward):
    assert letters_reward(text, charset) == pytest.approx(reward)


def test_letters_env_charset_from_config_and_row():
    env = make_env("letters")
    env.init(PROMPT, {})
    assert env.step("ab1!").reward == 0.5
    env = make_env("letters", {"charset": "digits"})
    assert env.init(PROMPT, {}) == PROMPT
    out = env.step("ab1!")
    assert (out.reward, out.done, out.observations) == (0.25, True, [])
    env = make_env("letters", {"charset": "digits"})
    env.init(PROMPT, {"charset": "letters"})  # the row overrides the config
    assert env.step("ab1!").reward == 0.5
    with pytest.raises(ValueError, match="charset"):
        make_env("letters", {"charset": "emoji"}).init(PROMPT, {})
    with pytest.raises(ValueError, match="charset"):
        letters_reward("abc", "Letters")


# ---------------------------------------------------------------------------------------------------------
# guess (multi-turn)


def _hint(out):
    return out.observations[0]["content"] if out.observations else None


def test_guess_success_on_turn_two():
    env = make_env("guess")
    assert env.init(PROMPT, {"target": 7}) == PROMPT
    out = env.step("I guess 3")
    assert (_hint(out), out.reward, out.done, out.metadata) == ("higher", 0.0, False, {"turn": 1})
    assert out.observations[0]["role"] == "user"
    out = env.step("3 was too low, so 7")  # the last integer counts
    assert (out.observations, out.reward, out.done, out.metadata) == ([], 1.0, True, {"turn": 2})


def test_guess_lower_and_no_number_then_out_of_turns():
    env = make_env("guess")
    env.init(PROMPT, {"target": 4, "high": 20, "max_turns": 3})
    out = env.step("15")
    assert (_hint(out), out.done, out.metadata["turn"]) == ("lower", False, 1)
    out = env.step("no idea")
    assert (_hint(out), out.done, out.metadata["turn"]) == ("no number found; answer with a number", False, 2)
    out = env.step("5")
    assert (out.observations, out.reward, out.done, out.metadata) == ([], 0.0, True, {"turn": 3})


def test_guess_max_turns_from_config_and_row():
    env = make_env("guess", {"max_turns": 1})
    env.init(PROMPT, {"target": 2})
    assert env.step("1").done is True
    env = make_env("guess", {"max_turns": 1})
    env.init(PROMPT, {"target": 2, "max_turns": 2})  # the row wins
    assert env.step("1").done is False
    env = make_env("guess")
    env.init(PROMPT, {"target": 2})  # default 3 turns
    assert [env.step("1").done for _ in range(3)] == [False, False, True]


@pytest.mark.parametrize(
    "extras, field",
    [({}, "target"), ({"target": 11}, "target"), ({"target": 0}, "target"), ({"target": "3"}, "target"),
     ({"target": 3, "high": 2}, "target"), ({"target": 3, "max_turns": 0}, "max_turns")],
)
def test_guess_validates_extras(extras, field):
    with pytest.raises(ValueError, match=field):
        make_env("guess").init(PROMPT, extras)


def test_guess_accepts_numpy_ints():
    env = make_env("guess")
    env.init(PROMPT, {"target": np.int64(3), "high": np.int64(5)})
    assert env.step("3").reward == 1.0


# ---------------------------------------------------------------------------------------------------------
# EnvPool


class Sleepy(Env):
    def __init__(self, delay: float, tag: int):
        super().__init__()
        self.delay, self.tag = delay, tag

    def init(self, prompt, extras):
        time.sleep(self.delay)
        return [{"role": "user", "content": f"{extras['n']}:{self.tag}"}]

    def step(self, action):
        time.sleep(self.delay)
        return StepOutput(reward=float(self.tag), metadata={"action": action, "thread": threading.get_ident()})


def test_pool_keeps_order():
    # The first envs sleep longest, so they finish last; results must still follow the input order.
    envs = [Sleepy(0.02 * (5 - i), i) for i in range(6)]
    with EnvPool(4) as pool:
        chats = pool.map_init(envs, [PROMPT] * 6, [{"n": i * 10} for i in range(6)])
        outs = pool.map_step(envs, [f"a{i}" for i in range(6)])
    assert chats == [[{"role": "user", "content": f"{i * 10}:{i}"}] for i in range(6)]
    assert [o.reward for o in outs] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert [o.metadata["action"] for o in outs] == [f"a{i}" for i in range(6)]


def test_pool_inline_runs_in_caller_thread():
    envs = [Sleepy(0.0, i) for i in range(3)]
    pool = EnvPool(0)
    assert pool.map_init(envs, [PROMPT] * 3, [{"n": 1}] * 3)[2] == [{"role": "user", "content": "1:2"}]
    outs = pool.map_step(envs, ["x", "y", "z"])
    assert [o.reward for o in outs] == [0.0, 1.0, 2.0]
    assert {o.metadata["thread"] for o in outs} == {threading.get_ident()}
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.map_step(envs, ["x", "y", "z"])


def test_pool_validates_arguments():
    with pytest.raises(ValueError, match="max_env_workers"):
        EnvPool(-1)
    with EnvPool(2) as pool, pytest.raises(ValueError, match="different lengths"):
        pool.map_step([Echo(), Echo()], ["a"])


class Broken(Env):
    def step(self, action):
        raise RuntimeError("kaput")


class BadInit(Echo):
    def init(self, prompt, extras):
        raise KeyError("question")


class WrongReturn(Env):
    def step(self, action):
        return {"reward": 1.0, "done": True}  # a SkyRL-style dict instead of a StepOutput


class NanReward(Env):
    def step(self, action):
        return StepOutput(reward=float("nan"))


class BadClose(Echo):
    def close(self):
        raise OSError("sandbox gone")


@pytest.mark.parametrize("workers", [0, 4])
def test_pool_isolates_env_errors(workers):
    envs = [Echo(), Broken(), Echo(), BadInit(), WrongReturn(), NanReward(), BadClose()]
    with EnvPool(workers) as pool:
        chats = pool.map_init(envs, [PROMPT] * len(envs), [{}] * len(envs))
        outs = pool.map_step(envs, ["ab", "x", "abc", "abcd", "x", "x", "abcde"])
        closed = pool.map_close(envs)
    assert chats == [PROMPT] * len(envs)  # a failed init hands back the prompt unchanged
    assert [o.reward for o in outs] == [2.0, 0.0, 3.0, 0.0, 0.0, 0.0, 5.0]
    assert all(o.done for o in outs)
    errors = [o.metadata.get("error") for o in outs]
    assert errors[0] is None and errors[2] is None and errors[6] is None
    assert errors[1] == "Broken.step raised RuntimeError: kaput"
    assert errors[3] == "BadInit.init raised KeyError: 'question'"  # reported at step; its step never ran
    assert "action" not in outs[3].metadata
    assert errors[4].startswith("WrongReturn.step raised TypeError: returned dict")
    assert errors[5].startswith("NanReward.step raised ValueError: StepOutput.reward")
    assert closed == [None] * 6 + ["BadClose.close raised OSError: sandbox gone"]


def test_pool_runs_slow_envs_concurrently():
    n, delay = 8, 0.2
    envs = [Sleepy(delay, i) for i in range(n)]
    with EnvPool(8) as pool:
        start = time.perf_counter()
        outs = pool.map_step(envs, ["a"] * n)
        elapsed = time.perf_counter() - start
    assert [o.reward for o in outs] == [float(i) for i in range(n)]
    assert len({o.metadata["thread"] for o in outs}) > 1
    assert elapsed < 0.5 * n * delay, f"{n} envs sleeping {delay}s took {elapsed:.2f}s: serialized?"
