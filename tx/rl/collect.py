"""A step's episodes: the training batch of every run, with `dynamic_sampling` drawing further data batches
for the runs that need them; the validation sweep; and the metrics of a set of episodes.

The data batches come from the trainer (`Draw`: sample the next data batch for the given runs, moving its
cursor), so that which rows a batch holds and how they are sampled stay the trainer's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from tx.rl import algorithms
from tx.rl.env import EnvPool
from tx.rl.policy import LocalPolicy, RemotePolicy
from tx.rl.rollout import ChatTokens, PromptRow, RolloutParams, Trajectory, rollout
from tx.rl.runs import Run

# the next data batch sampled for the given runs: (its index, each run's episodes); None when the data ran out
Draw = Callable[[dict[str, Run]], tuple[int, dict[str, list[Trajectory]]] | None]


def keep_groups(run: Run, trajectories: list[Trajectory], kept: list[list[Trajectory]], batch: int, n: int,
                size: int) -> tuple[list[list[Trajectory]], bool]:
    """`run`'s groups after data batch `batch`'s episodes (`n` per prompt) joined those `kept` so far, and whether
    it has its `size` groups. Without dynamic sampling: the batch as it is. `filter`: the groups whose rewards
    differ are added until `size`; `replace`: once more than `min_replace_ratio` of the batch's groups are good,
    the others' rows become copies of good groups' (chosen with a generator seeded by (seed, batch + 1, 2))."""
    groups: dict[int, list[Trajectory]] = {}
    for tr in trajectories:
        groups.setdefault(tr.group, []).append(tr)
    ds = run.cfg.trainer.algorithm.dynamic_sampling
    if ds.type is None:
        return list(groups.values()), True
    good_b = algorithms.dynamic_sampling_filter([tr.reward for tr in trajectories], [tr.group for tr in trajectories],
                                                n)
    good_g = {tr.group for tr, ok in zip(trajectories, good_b) if ok}
    good = [g for key, g in groups.items() if key in good_g]
    if ds.type == "filter":
        kept = kept + good
        return kept[:size], len(kept) >= size
    if len(good) > len(groups) * ds.min_replace_ratio:
        rng = np.random.default_rng([run.cfg.trainer.seed, batch + 1, 2])
        bad = [key for key in groups if key not in good_g]
        picks = rng.choice(len(good), len(bad), replace=len(bad) > len(good))
        for key, pick in zip(bad, picks):
            groups[key] = [replace(tr) for tr in good[pick]]
        return list(groups.values()), True
    return kept, False


def collect(runs: list[Run], draw: Draw, size: int, n: int, record: dict[str, Any],
            prefix: Callable[[Run], str]) -> dict[str, list[Trajectory]] | None:
    """This step's episodes of every run: `size` groups of `n` each (`keep_groups`). A further batch is drawn
    only for the runs that still need one; `dynamic_sampling/sampled_batches` goes into `record` per run that
    samples dynamically. Groups are renumbered 0.. in the order kept. None when the data ran out."""
    pending = {r.name: r for r in runs}
    kept: dict[str, list[list[Trajectory]]] = {name: [] for name in pending}
    tries = dict.fromkeys(pending, 0)
    while pending:
        drawn = draw(pending)
        if drawn is None:
            return None
        batch, out = drawn
        for name, trajectories in out.items():
            run, ds = pending[name], pending[name].cfg.trainer.algorithm.dynamic_sampling
            tries[name] += 1
            kept[name], done = keep_groups(run, trajectories, kept[name], batch, n, size)
            if not done and ds.max_sample_batches > 0 and tries[name] >= ds.max_sample_batches:
                raise RuntimeError(f"{prefix(run)}trainer.algorithm.dynamic_sampling: {tries[name]} batches sampled "
                                   f"(max_sample_batches={ds.max_sample_batches}) without enough prompts whose "
                                   "rewards differ")
            if done:
                del pending[name]
    for run in runs:
        for group, members in enumerate(kept[run.name]):
            for tr in members:
                tr.group = group
        if run.cfg.trainer.algorithm.dynamic_sampling.type:
            record[prefix(run) + "dynamic_sampling/sampled_batches"] = tries[run.name]
    return {name: [tr for members in kept[name] for tr in members] for name in kept}


def collect_eval(policy: LocalPolicy | RemotePolicy, chat: ChatTokens, runs: list[Run], rows: list[PromptRow],
                 size: int, params: RolloutParams, pool: EnvPool) -> dict[str, list[Trajectory]]:
    """Every row's episodes per run, in batches of `size` rows; groups numbered by row."""
    by_run: dict[str, list[Trajectory]] = {r.name: [] for r in runs}
    for lo in range(0, len(rows), size):
        part = rollout(policy, chat, {r.name: (r.cfg.trainer.seed, -1, lo) for r in runs}, rows[lo:lo + size],
                       params, pool)
        for name, trajectories in part.items():
            for tr in trajectories:
                tr.group += lo
            by_run[name] += trajectories
    return by_run


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, Any]:
    """Rewards (mean, std, pass@n over groups), generated lengths, the stop ratio and env errors of episodes."""
    rewards = np.array([tr.reward for tr in trajectories])
    lengths = np.array([tr.generated_tokens() for tr in trajectories])
    groups: dict[int, list[float]] = {}
    for tr in trajectories:
        groups.setdefault(tr.group, []).append(tr.reward)
    n = max(len(v) for v in groups.values())
    errors = sum(len(tr.env_errors) for tr in trajectories)
    return {"reward/avg_raw_reward": float(rewards.mean()), "reward/std_raw_reward": float(rewards.std()),
            f"reward/avg_pass_at_{n}": float(np.mean([max(v) > 0 for v in groups.values()])),
            "generate/avg_num_tokens": float(lengths.mean()), "generate/max_num_tokens": int(lengths.max()),
            "generate/stop_ratio": float(np.mean([tr.stop_reason == "stop" for tr in trajectories])),
            **({"environment/errors": errors} if errors else {})}
