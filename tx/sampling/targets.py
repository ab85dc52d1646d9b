"""`target_prompt_logprobs` on the host: layout checks, the named cells per prompt position, the answer.

Semantics (tinker 0.38, types/sample_request.py and the SamplingClient.sample docstring): an int64 tensor
of shape [len(prompt) - 1, K]; cell [i, j] is scored at prompt position i + 1, i.e. it is the log-prob of
that id under the model's next-token distribution after prompt[: i + 1] (position 0 has no context); a cell
of -1 asks for nothing and answers 0.0 (types/sample_response.py); dense, or sparse CSR (`crow` [rows + 1],
`col` and values for the listed cells only); the answer is float32 with the same shape and layout. The
server needs exactly len(prompt) - 1 rows and at least one id, and bounds the cost. tx's bound: at most
`cap` ids named at one position, since the device gathers [positions, max ids at a position] log-probs;
this accepts every request whose distinct ids fit the cap (the SDK's wording), and some more.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tx import types

FIELD = "target_prompt_logprobs"
MAX_DIM = 2**31 - 1  # shape entries go back to the client as int64; keep them far from any overflow


@dataclass(frozen=True)
class TargetPlan:
    """The named cells (id != -1) of one request, ordered by row: their index in the flat values, their row
    (prompt position - 1), their slot among that row's named cells, and their ids; `width` = most per row."""

    n_values: int
    value_index: np.ndarray  # int64 [n]
    row: np.ndarray  # int64 [n]
    slot: np.ndarray  # int64 [n]
    ids: np.ndarray  # int64 [n]
    width: int

    def device_ids(self, rows: int) -> np.ndarray:
        """int32 [rows, width]: the ids to score at each position (-1 = none)."""
        out = np.full((rows, self.width), -1, np.int32)
        out[self.row, self.slot] = self.ids
        return out


def _int64(values: list[int], where: str) -> np.ndarray:
    try:
        arr = np.asarray(values)
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError
        return arr.astype(np.int64).reshape(-1)
    except (ValueError, OverflowError, TypeError):
        raise ValueError(f"{where} must be a list of 64-bit integers") from None


def plan(t: types.TargetPromptIds, prompt_len: int, vocab: int, cap: int) -> TargetPlan:
    """Check `t` against a prompt of `prompt_len` tokens; raise ValueError naming the field and value."""
    rows, cols = t.shape
    if not (0 <= rows <= MAX_DIM and 0 <= cols <= MAX_DIM):
        raise ValueError(f"{FIELD} has shape {list(t.shape)}; entries must be in [0, {MAX_DIM}]")
    if rows != prompt_len - 1:
        raise ValueError(f"{FIELD} has shape {list(t.shape)}: it needs len(prompt) - 1 = {prompt_len - 1} rows "
                         "(row i scores prompt position i + 1)")
    ids = _int64(t.ids, f"{FIELD}.data")
    if (t.crow is None) != (t.col is None):
        raise ValueError(f"{FIELD}: sparse_crow_indices and sparse_col_indices must be sent together")
    if t.crow is None:
        if ids.size != rows * cols:
            raise ValueError(f"{FIELD} has {ids.size} values; dense shape {list(t.shape)} needs {rows * cols}")
        index = np.arange(ids.size, dtype=np.int64)
        row_of, col_of = index // max(cols, 1), index % max(cols, 1)
    else:
        crow = _int64(t.crow, f"{FIELD}.sparse_crow_indices")
        col_of = _int64(t.col, f"{FIELD}.sparse_col_indices")
        if crow.size != rows + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != ids.size:
            raise ValueError(f"{FIELD}.sparse_crow_indices must be {rows + 1} non-decreasing offsets from 0 to the "
                             f"{ids.size} values")
        if col_of.size != ids.size:
            raise ValueError(f"{FIELD}.sparse_col_indices has {col_of.size} entries for {ids.size} values")
        bad = np.flatnonzero((col_of < 0) | (col_of >= cols))
        if bad.size:
            raise ValueError(f"{FIELD}.sparse_col_indices[{bad[0]}] = {col_of[bad[0]]} is outside [0, {cols})")
        row_of = np.repeat(np.arange(rows, dtype=np.int64), np.diff(crow))
    bad = np.flatnonzero((ids < -1) | (ids >= vocab))
    if bad.size:
        i = bad[0]
        raise ValueError(f"{FIELD}[{row_of[i]}, {col_of[i]}] = {ids[i]} is outside the vocabulary [0, {vocab}) "
                         "(-1 = no id)")
    value_index = np.flatnonzero(ids != -1)
    if not value_index.size:
        raise ValueError(f"{FIELD} names no token id (every cell is -1)")
    row = row_of[value_index]
    counts = np.bincount(row, minlength=rows)
    width = int(counts.max())
    if width > cap:
        raise ValueError(f"{FIELD} names {width} ids at prompt position {int(np.argmax(counts)) + 1}; this server's "
                         f"limit is {cap} per position")
    slot = np.arange(row.size) - (np.cumsum(counts) - counts)[row]
    return TargetPlan(int(ids.size), value_index, row, slot, ids[value_index], width)


def answer(t: types.TargetPromptIds, p: TargetPlan, logprobs_rm: np.ndarray) -> types.TargetPromptLogprobs:
    """The response tensor: `logprobs_rm[row, slot]` at each named cell, 0.0 elsewhere, in `t`'s layout."""
    values = np.zeros(p.n_values, np.float32)
    values[p.value_index] = logprobs_rm[p.row, p.slot]
    return types.TargetPromptLogprobs(shape=t.shape, logprobs=values.tolist(), crow=t.crow, col=t.col)
