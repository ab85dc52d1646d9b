"""Provenance spans of forward_backward datums, and the stability info `stable_reinforce` trains with.

Tinker's `record_stability_info=True` asks the server to keep, per sampled sequence, what the loss needs
later; training datums name those sequences by `sequence_id` in provenance spans (`Datum.with_provenance`:
runs tiling `model_input` and `target_tokens`). tx keeps every sample's result (tokens and the sampler's
own per-token log-probs) with its future, so every sequence is recorded whatever the flag says; a
`sequence_id` is `<sample request id>:<index>` and resolves only for the tenant that sampled it.

For `stable_reinforce`, each datum's positions covered by a sampled-token run get the recorded sampler
log-prob as `logprobs` (the client's values there are ignored) and `sequence_ratio_mask` = 1; the
target token there must be the recorded token. Prompt-token runs must name a known sequence too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from tx.api.proto import pb
from tx.engine.ops import PassRequest, UserError

PROTO = "application/x-protobuf"

Lookup = Callable[[str], object | None]  # request_id -> FutureRow (or None)


class _Sequences:
    """Recorded sequences of one tenant, decoded once per sample request."""

    def __init__(self, lookup: Lookup, sees: Callable[[str | None], bool]):
        self._lookup, self._sees = lookup, sees
        self._responses: dict[str, pb.SampleResponse | None] = {}

    def get(self, sequence_id: str, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int32, sampler logprobs float32) of `sequence_id`; another tenant's id, an unknown one
        and an expired one get the same answer."""
        request_id, _, index = sequence_id.rpartition(":")
        response = self._response(request_id) if request_id and index.isdigit() else None
        if response is None or int(index) >= len(response.sequences):
            raise UserError(f"{where}: sequence_id {sequence_id!r} names no sequence sampled in this session "
                            "(unknown or expired)")
        seq = response.sequences[int(index)]
        return np.frombuffer(seq.tokens, np.int32), np.frombuffer(seq.logprobs, np.float32)

    def _response(self, request_id: str) -> pb.SampleResponse | None:
        if request_id not in self._responses:
            row = self._lookup(request_id)
            response = None
            if (row is not None and self._sees(row.owner) and row.kind == "sample" and row.status == "done"
                    and row.content_type == PROTO):
                response = pb.SampleResponse()
                response.ParseFromString(row.result)
            self._responses[request_id] = response
        return self._responses[request_id]


def _runs(spans, length: int, where: str) -> list[tuple[str, str, int, int]]:
    """(kind, sequence_id, offset, length) of each run, checked to tile `length` positions."""
    runs = []
    for j, span in enumerate(spans):
        kind = span.WhichOneof("span")
        if kind is None:
            raise UserError(f"{where}[{j}]: a provenance span must be prompt_tokens or sampled_tokens")
        run = getattr(span, kind)
        if run.offset < 0 or run.length < 0 or not run.sequence_id:
            raise UserError(f"{where}[{j}]: sequence_id must be set and offset, length >= 0")
        runs.append((kind, run.sequence_id, run.offset, run.length))
    total = sum(r[3] for r in runs)
    if total != length:
        raise UserError(f"{where}: the runs cover {total} positions but the field has {length}; they must tile it")
    return runs


def attach(request: PassRequest, msg: pb.ForwardBackwardRequest, lookup: Lookup,
           sees: Callable[[str | None], bool]) -> PassRequest:
    """`request` with provenance checked and, for stable_reinforce, the recorded sampler log-probs and
    mask filled in. A datum without spans is refused for stable_reinforce (it needs them)."""
    sequences = _Sequences(lookup, sees)
    datums = []
    for i, (datum, raw) in enumerate(zip(request.datums, msg.data, strict=True)):
        where = f"data[{i}]"
        has_inputs, has_targets = len(raw.model_input_spans) > 0, len(raw.loss_fn_input_spans) > 0
        if has_inputs != has_targets:
            raise UserError(f"{where}: model_input_spans and loss_fn_input_spans come as a pair (set both or neither)")
        if not has_targets:
            if request.loss_fn == "stable_reinforce":
                raise UserError(f"{where}: loss_fn 'stable_reinforce' needs provenance (Datum.with_provenance) naming "
                                "the sampled sequences behind its tokens")
            datums.append(datum)
            continue
        _runs(raw.model_input_spans, len(datum.input_ids), f"{where}.model_input_spans")
        targets = np.asarray(datum.targets)
        runs = _runs(raw.loss_fn_input_spans, len(targets), f"{where}.loss_fn_input_spans")
        if request.loss_fn != "stable_reinforce":
            datums.append(datum)
            continue
        if targets.ndim != 1:
            raise UserError(f"{where}.loss_fn_inputs['target_tokens']: stable_reinforce takes 1-D targets")
        n = len(targets)
        logprobs = np.asarray(datum.logprobs, np.float64) if datum.logprobs else np.zeros(n)
        mask = np.zeros(n)
        pos = 0
        for j, (kind, sequence_id, offset, length) in enumerate(runs):
            tokens, recorded = sequences.get(sequence_id, f"{where}.loss_fn_input_spans[{j}]")
            if kind == "sampled_tokens":
                if offset + length > len(tokens) or len(recorded) != len(tokens):
                    raise UserError(f"{where}.loss_fn_input_spans[{j}]: [{offset}, {offset + length}) is outside the "
                                    f"{len(tokens)} sampled tokens of {sequence_id!r}")
                got = targets[pos:pos + length]
                bad = np.flatnonzero(got != tokens[offset:offset + length])
                if bad.size:
                    at = pos + int(bad[0])
                    raise UserError(f"{where}.loss_fn_inputs['target_tokens'][{at}] = {int(targets[at])} but "
                                    f"{sequence_id!r} sampled {int(tokens[offset + bad[0]])} there")
                logprobs[pos:pos + length] = recorded[offset:offset + length]
                mask[pos:pos + length] = 1.0
            pos += length
        datums.append(replace(datum, logprobs=logprobs.tolist(), ratio_mask=mask.tolist()))
    return replace(request, datums=datums)
