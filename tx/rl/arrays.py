"""Host-side array helpers of the RL algorithms (numpy): float64 inside, float32 out, masked means, shape
checks, group ids."""

from __future__ import annotations

import numpy as np

# ---------------------------------------------------------------------------------------------------
# host helpers


def f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def masked_mean(x: np.ndarray, m: np.ndarray, axis=None):
    """SkyRL's masked_mean: sum(x*m) / max(sum(m), 1)."""
    return (x * m).sum(axis=axis) / np.maximum(m.sum(axis=axis), 1.0)


def safe_exp(d: np.ndarray) -> np.ndarray:
    """SkyRL's safe_exp_delta(clip=20): exp(clip(d, -20, 20))."""
    return np.exp(np.clip(d, -20.0, 20.0))


def check_bt(name: str, x: np.ndarray, shape: tuple[int, ...] | None = None) -> np.ndarray:
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D [sequences, positions], got shape {x.shape}")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name} has shape {x.shape}, expected {shape}")
    return x


def group_ids(group_b, n_rows: int) -> tuple[np.ndarray, int]:
    """Dense group index per row (0..G-1) and G, from any hashable ids (prompt uids)."""
    group_b = np.asarray(group_b)
    if group_b.shape != (n_rows,):
        raise ValueError(f"group_b has shape {group_b.shape}, expected ({n_rows},)")
    _, inverse = np.unique(group_b, return_inverse=True)
    inverse = inverse.reshape(-1)
    return inverse, int(inverse.max()) + 1 if n_rows else 0


def group_all_equal(scores_b: np.ndarray, gid_b: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group: (all scores identical, group size). Exact test instead of np.std(...) == 0, which is
    ~1e-17 rather than 0 for e.g. three equal scores of 0.1."""
    hi = np.full(n_groups, -np.inf)
    lo = np.full(n_groups, np.inf)
    np.maximum.at(hi, gid_b, scores_b)
    np.minimum.at(lo, gid_b, scores_b)
    return hi == lo, np.bincount(gid_b, minlength=n_groups)
