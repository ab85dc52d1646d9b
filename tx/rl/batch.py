"""Episodes as arrays: response-aligned [B, T] rows for the host-side algorithms, and back and forth between them
and a datum's per-target lists (target p of prompt + response predicts token p + 1, so response token i is
target len(prompt) - 1 + i)."""

from __future__ import annotations

import numpy as np

from tx.rl.rollout import Trajectory


def response_arrays(trajectories: list[Trajectory]) -> dict[str, np.ndarray]:
    """Right-padded [B, T] arrays over the response tokens: loss mask, response (1 on every token), sampler
    log-probs, token rewards (each turn's at its last token)."""
    b, t = len(trajectories), max(1, max(len(tr.response_ids) for tr in trajectories))
    out = {k: np.zeros((b, t), np.float64) for k in ("mask", "response", "logprobs", "rewards")}
    for i, tr in enumerate(trajectories):
        n = len(tr.response_ids)
        out["mask"][i, :n] = tr.loss_mask
        out["response"][i, :n] = 1.0
        out["logprobs"][i, :n] = tr.logprobs
        for pos, r in zip(tr.reward_positions, tr.turn_rewards):
            out["rewards"][i, pos] += r
    return out


def per_target(tr: Trajectory, values: np.ndarray) -> list[float]:
    """A response-aligned row as the datum's per-target list (0 over the prompt's targets)."""
    p = len(tr.prompt_ids)
    out = np.zeros(p + len(tr.response_ids) - 1)
    out[p - 1:] = values[: len(tr.response_ids)]
    return out.tolist()


def from_targets(trajectories: list[Trajectory], per_datum: list[np.ndarray], width: int | None = None) -> np.ndarray:
    """Per-target outputs of each episode's datum (log-probs, entropy, values) as response-aligned [B, T] rows,
    0 on padding."""
    t = width or max(1, max(len(tr.response_ids) for tr in trajectories))
    out = np.zeros((len(trajectories), t))
    for i, (tr, row) in enumerate(zip(trajectories, per_datum)):
        n = len(tr.response_ids)
        out[i, :n] = np.asarray(row, np.float64)[len(tr.prompt_ids) - 1:]
    return out


def datum(tr: Trajectory) -> dict:
    """The episode as a next-token datum: input ids and targets only."""
    full = tr.prompt_ids + tr.response_ids
    return {"input_ids": full[:-1], "targets": full[1:]}
