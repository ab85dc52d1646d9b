"""Tinker's protobuf bodies: ForwardBackwardRequest in, ForwardBackwardOutput and SampleResponse out.

Uses the message classes generated in the `tinker` SDK package (the schema is theirs); every decoded
field is checked here so that a bad datum fails its request with a message naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from tx import types
from tx.engine.ops import Datum, PassRequest, UserError

PROTO = "application/x-protobuf"
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
_INPUT_KEYS = {"target_tokens", "weights", "logprobs", "advantages"}
TOPK_EMPTY = -99999.0  # logprob of an unused top-k cell (the SDK decodes such rows as None)


def _tensor(msg: pb.Tensor, where: str, length: int) -> np.ndarray:
    """A proto Tensor as the per-token 1-D array of `length` values tx takes. The declared shape is
    checked before anything is allocated: a crafted shape ([2**32, 2**32], [-1, -4], a sparse [1, 10**13])
    is a UserError naming the field and the shape, never an allocation or a numpy error."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise UserError(f"{where}: unsupported dtype {msg.dtype}")
    shape = list(msg.shape)  # empty: the SDK left the shape out, the values are 1-D
    if any(n < 0 for n in shape):
        raise UserError(f"{where}: shape {shape} has a negative dimension")
    if msg.HasField("sparse_csr") or (shape and shape != [length]):
        layout = "sparse CSR " if msg.HasField("sparse_csr") else ""
        raise UserError(f"{where} has {layout}shape {shape}; tx supports dense per-token 1-D inputs of length "
                        f"{length} (the model_input's token count)")
    data = _frombuffer(msg.dense, dtype, where)
    if len(data) != length:
        raise UserError(f"{where} has {len(data)} entries but model_input has {length} tokens")
    return data


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
    """The datums of a ForwardBackwardRequest as backend inputs (each field checked)."""
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
        inputs = {k: _tensor(t, f"{where}.loss_fn_inputs[{k!r}]", len(ids)) for k, t in datum.loss_fn_inputs.items()
                  if k in _INPUT_KEYS}
        if "target_tokens" not in inputs:
            raise UserError(f"{where}.loss_fn_inputs: 'target_tokens' is required")
        empty: list[float] = []
        datums.append(Datum(
            input_ids=ids, targets=inputs["target_tokens"].astype(np.int64).tolist(),
            weights=inputs["weights"].astype(np.float64).tolist() if "weights" in inputs else empty,
            logprobs=inputs["logprobs"].astype(np.float64).tolist() if "logprobs" in inputs else empty,
            advantages=inputs["advantages"].astype(np.float64).tolist() if "advantages" in inputs else empty))
    if not datums:
        raise UserError("data: a forward/forward_backward request needs at least one datum")
    return PassRequest(datums=datums, loss_fn=msg.loss_fn, loss_fn_config=config or None)


def encode_pass(out: types.ForwardBackwardOutput) -> tuple[str, bytes]:
    """One ArrayRecord holding every datum: per field, the concatenated arrays and byte offsets."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type)
    msg.metrics.update(out.metrics)
    record = msg.loss_fn_outputs.add(type_tag=out.loss_fn_output_type, num_datums=len(out.loss_fn_outputs))
    keys = [k for k in (out.loss_fn_outputs[0] if out.loss_fn_outputs else {})
            if all(k in d for d in out.loss_fn_outputs)]
    for key in keys:
        arrays = [np.asarray(d[key].to_numpy(), np.float32) for d in out.loss_fn_outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        record.fields[key].CopyFrom(pb.BatchedTensor(
            data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32,
            trailing_shape=list(arrays[0].shape[1:]) if arrays else []))
    return PROTO, msg.SerializeToString()


def _topk(rows: list[list[tuple[int, float]] | None], k: int) -> pb.TopkLogprobs:
    ids = np.zeros((len(rows), k), np.int32)
    lps = np.full((len(rows), k), TOPK_EMPTY, np.float32)
    for i, row in enumerate(rows):
        for j, (token, lp) in enumerate((row or [])[:k]):
            ids[i, j], lps[i, j] = token, lp
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))


def _dense(array: np.ndarray, dtype: int) -> pb.Tensor:
    return pb.Tensor(dense=array.tobytes(), dtype=dtype, shape=list(array.shape))


def _target_logprobs(t: types.TargetPromptLogprobs) -> pb.Tensor:
    """float32, in the request's layout: dense, or CSR with its crow / col (the SDK decodes either)."""
    values = np.asarray(t.logprobs, np.float32)
    if t.crow is None:
        return _dense(values.reshape(t.shape), pb.DTYPE_FLOAT32)
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
    if out.target_prompt_logprobs is not None:
        msg.target_prompt_logprobs.CopyFrom(_target_logprobs(out.target_prompt_logprobs))
    if out.prompt_alt_tokens is not None:  # [len(prompt) - 1, k] pairs -> int64 ids and float32 log-probs
        pairs = np.asarray(out.prompt_alt_tokens, np.float64).reshape(len(out.prompt_alt_tokens), -1, 2)
        msg.prompt_alt_tokens.CopyFrom(pb.PromptAltTokens(
            tokens=_dense(pairs[..., 0].astype(np.int64), pb.DTYPE_INT64),
            logprobs=_dense(pairs[..., 1].astype(np.float32), pb.DTYPE_FLOAT32)))
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
