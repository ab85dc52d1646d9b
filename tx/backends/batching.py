"""Turn a PreparedModelPassBatch into validated rows and padded, bucketed device batches.

Validation happens per request before anything runs: a request with any bad datum gets an error that
names the datum, field and value, and the other requests of the batch go on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import numpy as np

from tx import losses, types
from tx.runtime import bucket_length, bucket_rows


@dataclass
class Row:
    """One validated datum."""

    request_index: int
    adapter: int
    input_ids: np.ndarray  # int32 [n]
    targets: np.ndarray  # int32 [n], or [n, K] (K targets per position)
    weights: np.ndarray  # float32, the shape of targets
    logprobs: np.ndarray  # float32 [n]
    advantages: np.ndarray  # float32 [n]
    ratio_mask: np.ndarray  # float32 [n]: sequence_ratio_mask
    loss: str  # its registered loss function
    config: dict[str, float]  # the loss's resolved loss_fn_config
    segment_ids: np.ndarray  # int32 [n]
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # float32 [n] per extra input key of its loss
    temperature: float = 1.0  # log-probs of softmax(logits / temperature)


CALL_COST_TOKENS = 256
"""What one more jit call costs, in padded tokens' worth (dispatch, a pass over the weights, adding the
call's gradients into the temporary): the planner trades it against padding, so it does not split a round
into many calls to save a few pad tokens."""


def padded_rows(n: int, multiple: int, max_rows: int = 0) -> int:
    """Rows of the device batch holding `n` rows: `bucket_rows`, capped at `max_rows` (0 = no cap; a
    multiple of `multiple`) so that a row cap never pads beyond itself."""
    rows = bucket_rows(n, multiple)
    return min(rows, max_rows) if max_rows else rows


def micro_batch_shape(lengths: Sequence[int], multiple: int, max_rows: int = 0) -> tuple[int, int]:
    """(rows, tokens per row) of the padded device batch of one micro-batch with these row lengths."""
    return padded_rows(len(lengths), multiple, max_rows), bucket_length(max(lengths))


def model_pass_shapes(max_seq_len: int, token_budget: int, max_rows: int = 0,
                      multiple: int = 1) -> list[tuple[int, int, int]]:
    """Every padded micro-batch shape forward / forward_backward can run under this configuration, as
    (rows, bucketed length, a row length <= max_seq_len that buckets to it): lengths are the buckets of
    `bucket_length` up to that of `max_seq_len`; rows are the `padded_rows` values whose shape fits
    `token_budget` (and `max_rows`), plus one row's, which runs alone when it does not fit. Without a
    budget or a row cap any row count is a shape: refused."""
    if not token_budget and not max_rows:
        raise ValueError("the micro-batch shapes are unbounded: set train_micro_batch_tokens or "
                         "train_micro_batch_size")
    lengths: dict[int, int] = {}
    for n in range(1, max_seq_len + 1):
        lengths[bucket_length(n)] = n  # the longest row of each bucket
    shapes = []
    for seq, n in sorted(lengths.items()):
        rows_seen, count = set(), 1
        while True:
            rows = padded_rows(count, multiple, max_rows)
            if rows in rows_seen or (count > 1 and token_budget and rows * seq > token_budget):
                break
            rows_seen.add(rows)
            shapes.append((rows, seq, n))
            count = rows + 1
    return shapes


def plan_micro_batches(lengths: Sequence[int], token_budget: int, max_rows: int = 0, multiple: int = 1,
                       call_cost: int = CALL_COST_TOKENS, known_shapes: AbstractSet[tuple[int, int]] = frozenset(),
                       new_shape_cost: int = 0) -> list[list[int]]:
    """Row indices of each jit call of a forward / forward_backward round, longest rows first.

    Rows are sorted by length (ties by index: every host computes the same plan from the same batch) and
    cut into consecutive groups minimising padded tokens + `call_cost` per call + `new_shape_cost` per
    call whose shape is not in `known_shapes` (a compile: it keeps the compile count low, e.g. equal SFT
    steps reuse one program instead of splitting off their padding rows) by an exact dynamic program over
    integer costs, subject to: a group's padded shape (`micro_batch_shape`) holds at most
    `token_budget` tokens, and at most `max_rows` rows when that is set. A group no bigger than one row
    bucket always fits, so a row longer than the budget runs as its own micro-batch. `token_budget=0`
    means no budget: consecutive groups of `max_rows` rows (all rows at once without a cap)."""
    if token_budget < 0 or max_rows < 0 or multiple < 1:
        raise ValueError(f"token_budget={token_budget}, max_rows={max_rows} must be >= 0 and multiple={multiple} >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = len(order)
    if not token_budget:
        m = max_rows or max(n, 1)
        return [order[i : i + m] for i in range(0, n, m)]
    k_max = min(n, max_rows) if max_rows else n
    rows_k = np.array([padded_rows(k, multiple, max_rows) for k in range(1, k_max + 1)], np.int64)
    best = np.full(n + 1, np.iinfo(np.int64).max, np.int64)  # best[j]: least cost of the first j rows
    best[0] = 0
    cut = np.zeros(n + 1, np.int64)  # the last group of that best plan starts at row cut[j]
    costs: dict[int, np.ndarray] = {}
    for i in range(n):
        seq = bucket_length(lengths[order[i]])  # the longest row of any group starting at i
        if seq not in costs:
            tokens = rows_k * seq
            fits = int(np.sum(tokens <= max(token_budget, tokens[0])))  # a prefix: rows_k never decreases
            new = np.array([(int(r), seq) not in known_shapes for r in rows_k[:fits]], np.int64)
            costs[seq] = tokens[:fits] + call_cost + new_shape_cost * new
        cand = best[i] + costs[seq][: n - i]
        window = slice(i + 1, i + 1 + len(cand))
        better = cand < best[window]
        best[window] = np.where(better, cand, best[window])
        cut[window] = np.where(better, i, cut[window])
    groups = []
    j = n
    while j > 0:
        groups.append(order[int(cut[j]) : j])
        j = int(cut[j])
    return groups[::-1]


def _float_field(name: str, values: list[float], n: int, datum: int) -> np.ndarray:
    """A per-token float input: empty means zeros; otherwise same length as the input and finite."""
    if len(values) == 0:
        return np.zeros(n, np.float32)
    if len(values) != n:
        raise ValueError(f"datum {datum}: {name} has {len(values)} entries but model_input has {n} tokens")
    arr = np.asarray(values, np.float64)
    with np.errstate(over="ignore"):
        device = arr.astype(np.float32)  # what the device sees: 1e39 is finite here but inf there
    bad = np.flatnonzero(~np.isfinite(device))
    if bad.size:
        where = "" if not np.isfinite(arr[bad[0]]) else " in float32"
        raise ValueError(f"datum {datum}: {name}[{bad[0]}] = {arr[bad[0]]} is not finite{where}")
    return device


def _token_field(name: str, values, vocab: int, datum: int) -> np.ndarray:
    arr = np.asarray(values, np.int64)
    bad = np.argwhere((arr < 0) | (arr >= vocab))
    if bad.size:
        at = tuple(int(j) for j in bad[0])
        raise ValueError(f"datum {datum}: {name}[{', '.join(map(str, at))}] = {arr[at]} is outside the vocabulary "
                         f"[0, {vocab})")
    return arr.astype(np.int32)


def _targets(values, n: int, loss: str, datum: int) -> np.ndarray:
    """target_tokens as [n] or [n, K]; 2-D only for a loss registered with `multi_target`."""
    try:
        arr = np.asarray(values, np.int64)
    except ValueError:
        raise ValueError(f"datum {datum}: target_tokens is not a rectangular [n] or [n, K] array") from None
    if arr.ndim not in (1, 2) or arr.shape[0] != n or (arr.ndim == 2 and arr.shape[1] < 1):
        raise ValueError(f"datum {datum}: target_tokens has shape {list(arr.shape)}; it must be [{n}] or [{n}, K] "
                         f"with K >= 1 (model_input has {n} tokens)")
    if arr.ndim == 2 and not losses.get(loss).multi_target:
        raise ValueError(f"datum {datum}: target_tokens has shape {list(arr.shape)}; loss {loss!r} takes 1-D "
                         f"targets only (2-D targets: {', '.join(n for n in losses.names() if losses.get(n).multi_target)})")
    return arr


def _weights(values, shape: tuple[int, ...], datum: int) -> np.ndarray:
    """weights shaped like target_tokens (empty = zeros), finite in float32."""
    if len(values) == 0:
        return np.zeros(shape, np.float32)
    try:
        arr = np.asarray(values, np.float64)
    except ValueError:
        raise ValueError(f"datum {datum}: weights is not a rectangular array") from None
    if arr.shape != shape:
        raise ValueError(f"datum {datum}: weights has shape {list(arr.shape)} but target_tokens has {list(shape)}")
    return _float_field("weights", arr.reshape(-1).tolist(), arr.size, datum).reshape(shape)


def _extra_inputs(extra_inputs: dict[str, list[list[float]]], i: int, spec: losses.LossSpec, n: int,
                  datum: int) -> dict[str, np.ndarray]:
    """The extra per-token inputs datum `i` sends, each finite in float32 and [n]; a key its loss does not
    read is refused (it would be silently ignored otherwise)."""
    for key, values in extra_inputs.items():
        if len(values[i]) and key not in spec.input_keys:
            reads = ", ".join(spec.input_keys) or "no extra inputs"
            raise ValueError(f"datum {datum}: loss_fn_inputs key {key!r} is not read by loss {spec.name!r} "
                             f"(it reads {reads})")
    return {key: _float_field(key, extra_inputs[key][i] if key in extra_inputs else [], n, datum)
            for key in spec.input_keys}


def validate(
    batch: types.PreparedModelPassBatch,
    adapter_of: Callable[[str], int],
    vocab: int,
    max_seq_len: int,
) -> tuple[list[Row], dict[int, str]]:
    """Rows of the valid requests, and an error message per invalid request (by slice index)."""
    masks = batch.all_ratio_masks
    extra_inputs = batch.all_extra_inputs or {}
    rows: list[Row] = []
    errors: dict[int, str] = {}
    for r, (_, _, start, end) in enumerate(batch.request_batch_slices):
        request_rows = []
        try:
            if start == end:
                raise ValueError("request has no datums")
            for i in range(start, end):
                model_id, ids = batch.all_model_ids[i], batch.all_input_ids[i]
                adapter = adapter_of(model_id)
                loss = batch.all_loss_fns[i]
                spec = losses.get(loss)
                config = losses.resolve_config(loss, batch.all_loss_fn_configs[i])
                for key, value in config.items():
                    types.float32_value(f"loss_fn_config[{key!r}]", value)
                n = len(ids)
                if n == 0:
                    raise ValueError(f"datum {i - start}: empty sequence")
                if n > max_seq_len:
                    raise ValueError(f"datum {i - start}: sequence of {n} tokens exceeds max_seq_len={max_seq_len}")
                targets = _targets(batch.all_targets[i], n, loss, i - start)
                segments = np.zeros(n, np.int32)
                if batch.all_segment_ids is not None:
                    segments = np.asarray(batch.all_segment_ids[i], np.int64)
                    if segments.shape != (n,) or np.any(np.diff(segments) < 0) or segments.min() < 0:
                        raise ValueError(f"datum {i - start}: segment_ids must be {n} non-decreasing ids >= 0")
                    segments = segments.astype(np.int32)
                request_rows.append(
                    Row(
                        request_index=r,
                        adapter=adapter,
                        input_ids=_token_field("model_input", ids, vocab, i - start),
                        targets=_token_field("target_tokens", targets, vocab, i - start),
                        weights=_weights(batch.all_token_weights[i], targets.shape, i - start),
                        logprobs=_float_field("logprobs", batch.all_sampling_logprobs[i], n, i - start),
                        advantages=_float_field("advantages", batch.all_advantages[i], n, i - start),
                        ratio_mask=_float_field("sequence_ratio_mask", masks[i] if masks else [], n, i - start),
                        loss=loss,
                        config=config,
                        segment_ids=segments,
                        extra=_extra_inputs(extra_inputs, i, spec, n, i - start),
                        temperature=_temperature(batch.all_temperatures, i, i - start),
                    )
                )
        except (KeyError, ValueError) as e:
            errors[r] = str(e.args[0]) if e.args else str(e)
            continue
        rows.extend(request_rows)
    return rows, errors


def _temperature(temperatures: list[float] | None, i: int, datum: int) -> float:
    if temperatures is None:
        return 1.0
    value = types.float32_value(f"datum {datum}: temperature", temperatures[i])
    if not value > 0:
        raise ValueError(f"datum {datum}: temperature = {temperatures[i]} must be > 0")
    return value


def loss_names_of(rows: list[Row]) -> tuple[str, ...]:
    """The losses these rows use, sorted: what a pass over them evaluates (and compiles for)."""
    return tuple(sorted({row.loss for row in rows}))


def pack(rows: list[Row], num_rows: int, seq_len: int, loss_names: Sequence[str]) -> dict[str, np.ndarray]:
    """Right-padded arrays; padding rows use adapter 0 and zero everything (they add exactly nothing).
    Targets and weights are [rows, seq_len, K], K the most target columns of any row (1-D rows fill
    column 0; the other columns weigh 0). `loss_names` are the pass's losses (each row's among them):
    "loss_index" points into it, "config" has a column per `losses.config_keys(loss_names)` and each of
    `losses.extra_input_keys(loss_names)` is a [rows, seq_len] float32 array (zeros in rows whose loss does
    not read it)."""
    keys, extra_keys = losses.config_keys(loss_names), losses.extra_input_keys(loss_names)
    k = max((r.targets.shape[1] for r in rows if r.targets.ndim == 2), default=1)
    out = {
        "input_ids": np.zeros((num_rows, seq_len), np.int32),
        "attention_mask": np.zeros((num_rows, seq_len), np.int32),
        "targets": np.zeros((num_rows, seq_len, k), np.int32),
        "weights": np.zeros((num_rows, seq_len, k), np.float32),
        "sequence_ratio_mask": np.zeros((num_rows, seq_len), np.float32),
        "logprobs": np.zeros((num_rows, seq_len), np.float32),
        "advantages": np.zeros((num_rows, seq_len), np.float32),
        "adapter": np.zeros(num_rows, np.int32),
        "loss_index": np.zeros(num_rows, np.int32),
        "config": np.zeros((num_rows, len(keys)), np.float32),
        "segment_ids": np.zeros((num_rows, seq_len), np.int32),
        "positions": np.zeros((num_rows, seq_len), np.int32),
        "temperature": np.ones(num_rows, np.float32),
    } | {key: np.zeros((num_rows, seq_len), np.float32) for key in extra_keys}
    for b, row in enumerate(rows):
        n = len(row.input_ids)
        out["input_ids"][b, :n] = row.input_ids
        out["attention_mask"][b, :n] = 1
        cols = row.targets.shape[1] if row.targets.ndim == 2 else 1
        out["targets"][b, :n, :cols] = row.targets.reshape(n, cols)
        out["weights"][b, :n, :cols] = row.weights.reshape(n, cols)
        out["sequence_ratio_mask"][b, :n] = row.ratio_mask
        out["logprobs"][b, :n] = row.logprobs
        out["advantages"][b, :n] = row.advantages
        for key, values in row.extra.items():
            out[key][b, :n] = values
        out["adapter"][b] = row.adapter
        out["loss_index"][b] = loss_names.index(row.loss)
        out["config"][b] = [row.config.get(k, 0.0) for k in keys]
        out["temperature"][b] = row.temperature
        seg = row.segment_ids
        out["segment_ids"][b, :n] = seg
        starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])  # first token of each segment
        out["positions"][b, :n] = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
    return out


def non_finite_output(rows: list[Row], members: list[int], logprobs: list[np.ndarray],
                       elementwise: list[np.ndarray]) -> str | None:
    """Why a request's outputs cannot be returned as a success (a non-finite value), or None."""
    for d, i in enumerate(members):
        for field, values in (("logprobs", logprobs[i]), ("elementwise_loss", elementwise[i])):
            bad = np.argwhere(~np.isfinite(values))
            if bad.size:
                at = tuple(int(j) for j in bad[0])
                return (f"datum {d}: {field}[{', '.join(map(str, at))}] = {values[at]} is not finite in float32 "
                        f"({largest_inputs(rows, [i])})")
    loss_sum = sum(elementwise[i].astype(np.float64).sum() for i in members)
    if not np.isfinite(loss_sum):
        return f"loss:sum = {loss_sum} is not finite"
    return None


def largest_inputs(rows: list[Row], members: list[int]) -> str:
    """The datums' inputs by largest magnitude, so an overflow names the field that caused it."""
    sizes = {field: max(float(np.abs(getattr(rows[i], field)).max(initial=0.0)) for i in members)
             for field in ("weights", "advantages", "logprobs")}
    sizes["loss_fn_config"] = max(max(map(abs, rows[i].config.values()), default=0.0) for i in members)
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])
    return "largest |inputs|: " + ", ".join(f"{field} {size:.3g}" for field, size in ranked)
