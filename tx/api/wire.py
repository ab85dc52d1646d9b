"""Tinker's protobuf bodies: ForwardBackwardRequest in, ForwardBackwardOutput and SampleResponse out.

Uses the message classes generated in the `tinker` SDK package (the schema is theirs); every decoded
field is checked here so that a bad datum fails its request with a message naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from tx import losses, types
from tx.api.proto import pb
from tx.engine.ops import Datum, PassRequest, UserError

PROTO = "application/x-protobuf"
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
_INPUT_KEYS = {"target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask"}
_TWO_D_KEYS = {"target_tokens", "weights"}  # may be [n, K] (top-k targets), dense or sparse CSR
MAX_TARGETS_PER_TOKEN = 128
"""K of 2-D targets at most: the device batch holds [rows, tokens, K] targets and weights."""
TOPK_EMPTY = -99999.0  # logprob of an unused top-k cell (the SDK decodes such rows as None)


def _tensor(msg: pb.Tensor, where: str, length: int, two_d: bool = False) -> np.ndarray:
    """A proto Tensor as the per-token array tx takes: [length], or [length, K] where `two_d` allows it
    (dense, or sparse CSR whose unlisted cells are 0, as the SDK sends 2-D torch tensors). The declared
    shape is checked before anything is allocated: a crafted shape ([2**32, 2**32], [-1, -4], a sparse
    [1, 10**13]) is a UserError naming the field and the shape, never an allocation or a numpy error."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise UserError(f"{where}: unsupported dtype {msg.dtype}")
    shape = list(msg.shape)  # empty: the SDK left the shape out, the values are 1-D
    if any(n < 0 for n in shape):
        raise UserError(f"{where}: shape {shape} has a negative dimension")
    sparse = msg.HasField("sparse_csr")
    if two_d and len(shape) == 2 and shape[0] == length:
        if not 1 <= shape[1] <= MAX_TARGETS_PER_TOKEN:
            raise UserError(f"{where} has shape {shape}; K must be between 1 and {MAX_TARGETS_PER_TOKEN}")
        return _csr(msg.sparse_csr, dtype, shape, where) if sparse else _dense(msg.dense, dtype, shape, where)
    if sparse or (shape and shape != [length]):
        layout = "sparse CSR " if sparse else ""
        want = f"[{length}] or [{length}, K]" if two_d else f"[{length}]"
        raise UserError(f"{where} has {layout}shape {shape}; tx takes {want} here (model_input has {length} tokens)")
    return _dense(msg.dense, dtype, [length], where)


def _dense(raw: bytes, dtype, shape: list[int], where: str) -> np.ndarray:
    data = _frombuffer(raw, dtype, where)
    if len(data) != int(np.prod(shape)):
        raise UserError(f"{where} has {len(data)} entries but its shape {shape} needs {int(np.prod(shape))}"
                        if len(shape) > 1 else f"{where} has {len(data)} entries but model_input has {shape[0]} tokens")
    return data.reshape(shape)


def _csr(csr: pb.SparseCsr, dtype, shape: list[int], where: str) -> np.ndarray:
    """A sparse CSR [n, K] matrix, densified with 0 in the unlisted cells; every index checked."""
    values = _frombuffer(csr.values, dtype, f"{where}.values")
    crow = _frombuffer(csr.crow_indices, np.int64, f"{where}.crow_indices")
    col = _frombuffer(csr.col_indices, np.int64, f"{where}.col_indices")
    n, k = shape
    if len(crow) != n + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0) or crow[-1] != len(col):
        raise UserError(f"{where}: crow_indices must be {n + 1} non-decreasing offsets from 0 to {len(col)}")
    if len(values) != len(col):
        raise UserError(f"{where}: {len(values)} values for {len(col)} col_indices")
    if np.any((col < 0) | (col >= k)):
        raise UserError(f"{where}: col_indices must be in [0, {k})")
    out = np.zeros(shape, dtype)
    out[np.repeat(np.arange(n), np.diff(crow)), col] = values
    return out


def _frombuffer(raw: bytes, dtype, where: str) -> np.ndarray:
    if len(raw) % np.dtype(dtype).itemsize:
        raise UserError(f"{where}: {len(raw)} bytes is not a whole number of {np.dtype(dtype).name} values")
    return np.frombuffer(raw, dtype)


def _tokens(datum: pb.Datum, where: str) -> list[int]:
    tokens: list[int] = []
    for c, chunk in enumerate(datum.model_input):
        which = chunk.WhichOneof("chunk")
        if which != "encoded_text":
            raise UserError(f"{where}.model_input.chunks[{c}]: {which} chunks are not supported (text models only)")
        tokens += _frombuffer(chunk.encoded_text.tokens, np.int32, f"{where}.model_input").tolist()
    return tokens


def decode_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise UserError(f"the body is not a valid ForwardBackwardRequest protobuf: {e}") from None
    return msg


@dataclass(frozen=True)
class PassEnvelope:
    """What sequences a forward/forward_backward request; known before any datum tensor is decoded, so
    that a bad tensor is refused in the model's seq_id order (and consumes its seq_id)."""

    model_id: str
    seq_id: int
    forward_only: bool
    num_datums: int


def envelope(msg: pb.ForwardBackwardRequest) -> PassEnvelope:
    if msg.seq_id < 1:
        raise UserError(f"seq_id {msg.seq_id} must be >= 1")
    return PassEnvelope(msg.model_id, msg.seq_id, msg.forward_only, len(msg.data))


def pass_request(msg: pb.ForwardBackwardRequest) -> PassRequest:
    """The datums of a ForwardBackwardRequest as backend inputs (each field checked). Provenance spans
    are checked and resolved separately (`tx.api.stability`), where the store is at hand."""
    config: dict[str, float] = {}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise UserError(f"loss_fn_config[{key!r}]: only numbers are supported, got {value.text!r}")
        config[key] = value.number
    for key, value in msg.loss_fn_config.items():
        config.setdefault(key, value)
    datums = []
    for i, datum in enumerate(msg.data):
        where = f"data[{i}]"
        ids = _tokens(datum, where)
        extra_keys = losses.extra_input_keys()  # per-token inputs of registered losses (e.g. reference log-probs)
        inputs = {k: _tensor(t, f"{where}.loss_fn_inputs[{k!r}]", len(ids), k in _TWO_D_KEYS)
                  for k, t in datum.loss_fn_inputs.items() if k in _INPUT_KEYS or k in extra_keys}
        if "target_tokens" not in inputs:
            raise UserError(f"{where}.loss_fn_inputs: 'target_tokens' is required")
        targets = inputs["target_tokens"]
        if "weights" in inputs and inputs["weights"].shape != targets.shape:
            raise UserError(f"{where}.loss_fn_inputs['weights'] has shape {list(inputs['weights'].shape)} but "
                            f"'target_tokens' has {list(targets.shape)}; they must be equal")
        empty: list[float] = []
        mask = inputs.get("sequence_ratio_mask")
        if mask is None and msg.loss_fn == "gspo" and "advantages" in inputs:
            # tx's default when the mask is left out (the cookbook's rl/train.py does): the sequence ratio
            # runs over the tokens that carry an advantage, i.e. the sampled ones, not the prompt padding
            mask = (inputs["advantages"] != 0).astype(np.float32)
        datums.append(Datum(
            input_ids=ids, targets=targets.astype(np.int64).tolist(),
            weights=inputs["weights"].astype(np.float64).tolist() if "weights" in inputs else empty,
            logprobs=inputs["logprobs"].astype(np.float64).tolist() if "logprobs" in inputs else empty,
            advantages=inputs["advantages"].astype(np.float64).tolist() if "advantages" in inputs else empty,
            ratio_mask=mask.astype(np.float64).tolist() if mask is not None else empty,
            extra_inputs={k: inputs[k].astype(np.float64).tolist() for k in extra_keys if k in inputs}))
    if not datums:
        raise UserError("data: a forward/forward_backward request needs at least one datum")
    return PassRequest(datums=datums, loss_fn=msg.loss_fn, loss_fn_config=config or None)


def encode_pass(out: types.ForwardBackwardOutput) -> tuple[str, bytes]:
    """ArrayRecords holding every datum: per field, the concatenated arrays and byte offsets. Datums
    whose outputs differ in trailing shape (1-D next to [n, K] log-probs, or two Ks) go in separate
    consecutive records, as the SDK decodes ragged outputs."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type)
    msg.metrics.update(out.metrics)
    outputs = out.loss_fn_outputs
    keys = [k for k in (outputs[0] if outputs else {}) if all(k in d for d in outputs)]
    arrays = [{k: np.asarray(d[k].to_numpy(), np.float32) for k in keys} for d in outputs]
    runs: list[list[dict[str, np.ndarray]]] = []
    for a in arrays:
        trailing = {k: v.shape[1:] for k, v in a.items()}
        if runs and {k: v.shape[1:] for k, v in runs[-1][0].items()} == trailing:
            runs[-1].append(a)
        else:
            runs.append([a])
    for run in runs or [[]]:
        record = msg.loss_fn_outputs.add(type_tag=out.loss_fn_output_type, num_datums=len(run))
        for key in keys:
            parts = [a[key] for a in run]
            offsets = np.cumsum([0] + [p.nbytes for p in parts]).astype(np.int64)
            record.fields[key].CopyFrom(pb.BatchedTensor(
                data=b"".join(p.tobytes() for p in parts), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32,
                trailing_shape=list(parts[0].shape[1:]) if parts else []))
    return PROTO, msg.SerializeToString()


def _topk(rows: list[list[tuple[int, float]] | None], k: int) -> pb.TopkLogprobs:
    ids = np.zeros((len(rows), k), np.int32)
    lps = np.full((len(rows), k), TOPK_EMPTY, np.float32)
    for i, row in enumerate(rows):
        for j, (token, lp) in enumerate((row or [])[:k]):
            ids[i, j], lps[i, j] = token, lp
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))


def _dense_tensor(array: np.ndarray, dtype: int) -> pb.Tensor:
    return pb.Tensor(dense=array.tobytes(), dtype=dtype, shape=list(array.shape))


def _target_logprobs(t: types.TargetPromptLogprobs) -> pb.Tensor:
    """float32, in the request's layout: dense, or CSR with its crow / col (the SDK decodes either)."""
    values = np.asarray(t.logprobs, np.float32)
    if t.crow is None:
        return _dense_tensor(values.reshape(t.shape), pb.DTYPE_FLOAT32)
    csr = pb.SparseCsr(values=values.tobytes(), crow_indices=np.asarray(t.crow, np.int64).tobytes(),
                       col_indices=np.asarray(t.col, np.int64).tobytes())
    return pb.Tensor(sparse_csr=csr, dtype=pb.DTYPE_FLOAT32, shape=list(t.shape))


def encode_sample(out: types.SampleOutput) -> tuple[str, bytes]:
    msg = pb.SampleResponse()
    for seq in out.sequences:
        entry = msg.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, np.float32).tobytes())
        if seq.topk_logprobs is not None:
            entry.topk_sampled_logprobs.CopyFrom(_topk(seq.topk_logprobs, max(map(len, seq.topk_logprobs), default=0)))
    msg.prompt_cache_hit_tokens = out.prompt_cache_hit_tokens
    if out.target_prompt_logprobs is not None:
        msg.target_prompt_logprobs.CopyFrom(_target_logprobs(out.target_prompt_logprobs))
    if out.prompt_alt_tokens is not None:  # [len(prompt) - 1, k] pairs -> int64 ids and float32 log-probs
        pairs = np.asarray(out.prompt_alt_tokens, np.float64).reshape(len(out.prompt_alt_tokens), -1, 2)
        msg.prompt_alt_tokens.CopyFrom(pb.PromptAltTokens(
            tokens=_dense_tensor(pairs[..., 0].astype(np.int64), pb.DTYPE_INT64),
            logprobs=_dense_tensor(pairs[..., 1].astype(np.float32), pb.DTYPE_FLOAT32)))
    if out.prompt_logprobs is not None:
        lp = np.asarray([np.nan if v is None else v for v in out.prompt_logprobs], np.float32)
        msg.prompt_logprobs = lp.tobytes()
    if out.topk_prompt_logprobs is not None:
        k = max((len(r) for r in out.topk_prompt_logprobs if r), default=0)
        if k:
            msg.topk_prompt_logprobs.CopyFrom(_topk(out.topk_prompt_logprobs, k))
    return PROTO, msg.SerializeToString()


def token_count(msg: pb.ForwardBackwardRequest) -> int:
    """Input tokens of every datum, read from the encoded chunk sizes (int32 each) without decoding them."""
    return sum(len(c.encoded_text.tokens) // 4 for d in msg.data for c in d.model_input
               if c.WhichOneof("chunk") == "encoded_text")
