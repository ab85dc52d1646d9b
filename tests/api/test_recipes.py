"""tinker-cookbook 0.6.1's recipes, unmodified, against one real `python -m tx.run` server: `rl_loop` and
`math_rl` (both on their default loss, stable_reinforce), `rl_basic` with a KL penalty against the base
model, SDFT with top-20 teacher targets, DPO, and the `decisions` demo. Each runs a couple of steps with
tiny batches; the test checks the recipe's own metrics are finite and that the server saw the calls
the recipe makes (`/api/v1/metrics`, counted before and after the run).

A random tiny model never earns an RL reward, so the two RL recipes start from an adapter warm-started
by a short SFT run through the SDK, as a user would: `math_rl` loads it with `load_checkpoint_path`, and
`rl_loop` (which has no such option) resumes from it through its own `checkpoints.jsonl`.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.api.recipe_data import GSM8K, MODEL, recipe_env, write_run_dir
from tests.api.sdk_flows import service
from tests.api.server_proc import ADMIN_KEY, API_KEY, Server
from tests.require import require_module

require_module("tinker_cookbook")
pytestmark = pytest.mark.slow

SDFT_TOPK = 20


class Lab:
    """The server, the directory recipes run in, and helpers to run a recipe and read the server's counters."""

    def __init__(self, root: Path, tiny_dir: str):
        self.root, self.run_dir = root, root / "run"
        write_run_dir(self.run_dir, tiny_dir)
        # DPO's CLI has no lora_rank (it trains rank 32); teacher prompts of SDFT are a few hundred tokens
        self.server = Server(root / "data", "--session-timeout-s", "600", "--max-seq-len", "512",
                             "--max-lora-rank", "32", cwd=self.run_dir, base_model=MODEL)
        self.env = recipe_env(self.server.url, API_KEY, root / "hf_home")

    def counters(self) -> dict[str, int]:
        r = self.server.get("/api/v1/metrics", key=ADMIN_KEY)
        assert r.status_code == 200, r.text
        return r.json()["engine"]

    def run(self, name: str, module: str, *args: str, stdin: str = "", timeout: float = 300) -> tuple[str, dict]:
        """Run `python -m module args...` to completion; returns its output and the server counters it moved."""
        before = self.counters()
        log = self.root / f"{name}.log"
        start = time.time()
        with open(log, "w") as out:
            try:
                rc = subprocess.run([sys.executable, "-m", module, *args], cwd=self.run_dir, env=self.env,
                                    input=stdin, text=True, stdout=out, stderr=subprocess.STDOUT,
                                    timeout=timeout, check=False).returncode
            except subprocess.TimeoutExpired:
                rc = None
        text = log.read_text()
        assert rc == 0, (f"{name} exited {rc} after {time.time() - start:.0f} s\n--- recipe ---\n{text[-6000:]}"
                         f"\n--- server ---\n{self.server.log()[-6000:]}")
        after = self.counters()
        return text, {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


@pytest.fixture(scope="module")
def lab(tmp_path_factory, tiny_dirs):
    lab = Lab(tmp_path_factory.mktemp("recipes"), tiny_dirs["dense"])
    yield lab
    lab.server.stop()


def renderer(lab: Lab):
    """The renderer the recipes pick for MODEL, over the tiny model's tokenizer (read from the run directory)."""
    from tinker_cookbook import model_info, renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    return renderers.get_renderer(model_info.get_recommended_renderer_name(MODEL), get_tokenizer(str(lab.run_dir / MODEL)))


def warm_start(lab: Lab, conversations: list[list[dict]], steps: int = 30, lr: float = 1e-2, seed: int = 1):
    """SFT a fresh rank-8 adapter on the last assistant turn of each conversation; returns its TrainingClient.
    The adapter's initialisation is seeded, so the warm start is the same in every run (unseeded, it varied:
    in one CI run math_rl's warm-started policy sampled only malformed answers)."""
    from tinker import types
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised.data import conversation_to_datum

    rend = renderer(lab)
    data = [conversation_to_datum(c, rend, None, TrainOnWhat.LAST_ASSISTANT_MESSAGE) for c in conversations]
    client = service(lab.server.url).create_lora_training_client(base_model=MODEL, rank=8, seed=seed).result()
    for _ in range(steps):
        fb = client.forward_backward(data, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=lr)).result()
        fb.result()
    return client


def metrics_of(log_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert rows, f"{log_dir}/metrics.jsonl is empty"
    return rows


def assert_finite(rows: list[dict], *keys: str) -> None:
    for row in rows:
        for key in keys:
            assert key in row and math.isfinite(row[key]), (key, row)


def assert_called(moved: dict[str, int], **at_least: int) -> None:
    short = {k: n for k, n in at_least.items() if moved.get(k, 0) < n}
    assert not short, f"server counters moved {moved}; expected at least {at_least}"


# ---- RL ----

# rl_loop's prompt: its one-shot example, then the GSM8K question with its suffix (all in rl_loop.main)
RL_LOOP_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
RL_LOOP_SHOT = [
    {"role": "user", "content": "How many r's are in strawberry?" + RL_LOOP_SUFFIX},
    {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a "
                                     "5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. "
                                     "\\boxed{3}"},
]


def test_rl_loop_default_loss_from_warm_start(lab):
    from tinker_cookbook import checkpoint_utils

    # Half the SFT answers are right for each question: the warm policy answers \boxed{3} or \boxed{4}
    # about evenly, so most groups of 4 hold both rewards and rl_loop (which skips all-equal groups) trains.
    convos = [RL_LOOP_SHOT + [{"role": "user", "content": q + RL_LOOP_SUFFIX},
                              {"role": "assistant", "content": f"\\boxed{{{n}}}"}]
              for q, _ in GSM8K for n in (3, 4)]
    log_dir = lab.root / "rl_loop"
    log_dir.mkdir()
    checkpoint_utils.save_checkpoint(training_client=warm_start(lab, convos), name="warm", log_path=str(log_dir),
                                     kind="state", loop_state={"batch": 0})
    out, moved = lab.run("rl_loop", "tinker_cookbook.recipes.rl_loop", f"base_url={lab.server.url}",
                         f"model_name={MODEL}", "batch_size=2", "group_size=4", "max_tokens=32", "max_steps=2",
                         f"log_path={log_dir}")
    assert "Resuming from batch 0" in out, out[-3000:]
    rows = metrics_of(log_dir)
    assert [r["step"] for r in rows] == [0, 1], rows
    assert_finite(rows, "reward/total")
    assert max(r["reward/total"] for r in rows) > 0, rows
    trained = [r for r in rows if "grad_norm" in r]  # a step with an optimizer step reports its norms
    assert trained, f"no step had a group with mixed rewards: {rows}"
    assert_finite(trained, "grad_norm", "update_norm")
    assert_called(moved, submitted_create_from_state=1,
                  forward_backward_requests_stable_reinforce=len(trained), submitted_optim_step=len(trained),
                  submitted_save_weights_for_sampler=2, submitted_sample=2, sample_calls=1)


def arithmetic_problems(lab: Lab, n_batches: int) -> list[list[dict]]:
    """The first n batches of math_rl's arithmetic set (one group each), solved: batch i is seeded by i."""
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDataset

    data = ArithmeticDataset(batch_size=1, renderer=renderer(lab), group_size=2)
    envs = [data.get_batch(i)[0].env_thunk() for i in range(n_batches)]
    return [e.convo_prefix + [{"role": "user", "content": e.get_question()},
                              {"role": "assistant", "content": e.get_reference_answer()}] for e in envs]


def test_math_rl_arithmetic_from_warm_start(lab):
    # 60 steps from seed 3: the 2 problems' answers memorised firmly enough that 4 samples at T=1 reliably hold a
    # correct one (sampled 16 times each after this warm start: 16 + 16 and 16 + 15 correct; seed 1: 10 + 10)
    state = warm_start(lab, arithmetic_problems(lab, 2), steps=60, seed=3).save_state("arith-warm").result().path
    log_dir = lab.root / "math_rl"
    _, moved = lab.run("math_rl", "tinker_cookbook.recipes.math_rl.train", f"base_url={lab.server.url}",
                       f"model_name={MODEL}", "env=arithmetic", "group_size=2", "groups_per_batch=1",
                       "max_tokens=24", "max_steps=2", "lora_rank=8", "eval_every=0", "save_every=0",
                       f"load_checkpoint_path={state}", f"log_path={log_dir}", "behavior_if_log_dir_exists=delete")
    rows = metrics_of(log_dir)[:2]  # a last row holds the final cumulative counts only
    assert [r["step"] for r in rows] == [0, 1], rows
    assert_finite(rows, "env/all/reward/total", "env/all/correct", "grad_norm", "optim/entropy",
                  "optim/kl_sample_train_v1")
    assert max(r["env/all/correct"] for r in rows) > 0, rows
    assert_called(moved, submitted_create_from_state=1, forward_backward_requests_stable_reinforce=2,
                  submitted_optim_step=2, submitted_sample=4)


def test_rl_basic_kl_against_base_model(lab):
    log_dir = lab.root / "rl_basic"
    _, moved = lab.run("rl_basic", "tinker_cookbook.recipes.rl_basic", f"base_url={lab.server.url}",
                       f"model_name={MODEL}", "dataset_builder=tinker_cookbook.recipes.math_rl.math_env:"
                       "Gsm8kDatasetBuilder", "dataset_builder.batch_size=2", "dataset_builder.group_size=2",
                       "dataset_builder.renderer_name=qwen3", f"dataset_builder.model_name_for_tokenizer={MODEL}",
                       "max_tokens=8", "max_steps=2", "lora_rank=8", "save_every=0", "kl_penalty_coef=0.1",
                       f"kl_reference_config.base_model={MODEL}", f"log_path={log_dir}")
    rows = metrics_of(log_dir)
    assert [r["step"] for r in rows][:2] == [0, 1], rows
    assert_finite(rows[:2], "env/all/reward/total", "kl_policy_base", "grad_norm")
    # the adapter starts at zero (LoRA B = 0), so the first KL against the base model is ~0; one Adam step
    # moves the policy, and the second is not
    assert abs(rows[0]["kl_policy_base"]) < 1e-5 and rows[1]["kl_policy_base"] != rows[0]["kl_policy_base"], rows
    assert_called(moved, forward_backward_requests_importance_sampling=2, submitted_optim_step=2,
                  submitted_sample=8)


# ---- distillation and preferences ----


def test_sdft_topk_targets(lab):
    log_dir = lab.root / "sdft"
    _, moved = lab.run("sdft", "tinker_cookbook.recipes.sdft.train", f"base_url={lab.server.url}",
                       f"model_name={MODEL}", "dataset=toolalpaca", f"toolalpaca_data_path={lab.run_dir / 'toolalpaca'}",
                       f"topk={SDFT_TOPK}", "group_size=1", "groups_per_batch=2", "max_tokens=8", "max_steps=2",
                       "lora_rank=8", "eval_every=0", "save_every=0", "max_context_length=512",
                       f"log_path={log_dir}", "behavior_if_log_dir_exists=delete")
    rows = metrics_of(log_dir)
    assert [r["sdft/topk"] for r in rows[:2]] == [SDFT_TOPK, SDFT_TOPK], rows
    assert_finite(rows[:2], "sdft/mean_teacher_entropy", "grad_norm", "update_norm")
    assert all(r["sdft/num_datums"] == 2 for r in rows[:2]), rows
    assert_called(moved, forward_backward_requests_cross_entropy=2, submitted_optim_step=2, submitted_sample=4)


def test_dpo(lab):
    log_dir = lab.root / "dpo"
    _, moved = lab.run("dpo", "tinker_cookbook.recipes.preference.dpo.train", f"base_url={lab.server.url}",
                       f"model_name={MODEL}", "dataset=hhh", "batch_size=2", "max_steps=2", "max_length=256",
                       "learning_rate=1e-3", f"log_path={log_dir}", "behavior_if_log_dir_exists=delete")
    rows = metrics_of(log_dir)
    assert [r["step"] for r in rows] == [0, 1], rows
    assert_finite(rows, "dpo_loss", "margin", "chosen_reward", "rejected_reward", "test/nll")
    # the policy starts equal to the reference: the first loss is log 2
    assert rows[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-4), rows[0]
    assert rows[1]["dpo_loss"] < rows[0]["dpo_loss"], rows
    assert_called(moved, forward_requests_cross_entropy=2, forward_backward_requests_cross_entropy=2,
                  submitted_optim_step=2)


# ---- decisions ----


def test_decisions_demo(lab):
    from tinker_cookbook.recipes.decisions.demo import TEAMS

    out, moved = lab.run("decisions", "tinker_cookbook.recipes.decisions.demo", f"model_name={MODEL}",
                         stdin="How do I pay my invoice?\nWhere is my API key?\n\n")
    answers = [json.loads(block) for block in re.findall(r"\{[^{}]*\}", out)]  # one JSON object per question
    teams = [t for t, _ in TEAMS]
    assert len(answers) == 2, out[-3000:]
    for probs in answers:
        assert list(probs) == teams and all(0 <= p <= 1 for p in probs.values()), probs
        assert sum(probs.values()) == pytest.approx(1, abs=4e-4), probs  # rounded to 4 decimals
    assert_called(moved, submitted_sample=2)
