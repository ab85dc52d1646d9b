"""JSON forward/forward_backward bodies of older `tinker` SDKs, turned into the protobuf message that
tx/api/wire.py decodes, so that both encodings go through the same checks.

SDKs before 0.25 send ForwardBackwardRequest as JSON unless the server's client config sets
`proto_write_fwdbwd` (0.19-0.24 honour it); SDKs before 0.22 send `forward` to /api/v1/forward, always
as JSON ({"forward_input": ..., "model_id", "seq_id"}). The JSON shapes are those SDKs' pydantic types:
TensorData {data, dtype, shape?, sparse_crow_indices?, sparse_col_indices?}, chunks {type, tokens}.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from tx.api import bodies, wire
from tx.api.proto import pb
from tx.engine.ops import UserError

_DTYPES = {"float32": (pb.DTYPE_FLOAT32, np.float32), "int64": (pb.DTYPE_INT64, np.int64)}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TensorData(_Body):
    data: list[int] | list[float]
    dtype: Literal["float32", "int64"]
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class Chunk(_Body):
    type: str
    tokens: list[int] | None = None


class ModelInput(_Body):
    chunks: list[Chunk]


class Datum(_Body):
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData]


class PassInput(_Body):
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None


class ForwardBackwardRequest(_Body):
    forward_backward_input: PassInput
    model_id: str
    seq_id: int | None = None


class ForwardRequest(_Body):
    forward_input: PassInput
    model_id: str
    seq_id: int | None = None


def _tensor(td: TensorData, where: str) -> pb.Tensor:
    dtype, np_dtype = _DTYPES[td.dtype]
    if td.dtype == "int64" and not all(isinstance(v, int) for v in td.data):
        raise UserError(f"{where}: dtype int64 needs integer values")
    try:
        values = np.asarray(td.data, np_dtype)
    except OverflowError:
        raise UserError(f"{where}: a value does not fit {td.dtype}") from None
    msg = pb.Tensor(dtype=dtype, shape=td.shape or [])
    if td.sparse_crow_indices is not None or td.sparse_col_indices is not None:
        if td.sparse_crow_indices is None or td.sparse_col_indices is None:
            raise UserError(f"{where}: sparse_crow_indices and sparse_col_indices go together")
        msg.sparse_csr.values = values.tobytes()
        msg.sparse_csr.crow_indices = np.asarray(td.sparse_crow_indices, np.int64).tobytes()
        msg.sparse_csr.col_indices = np.asarray(td.sparse_col_indices, np.int64).tobytes()
    else:
        msg.dense = values.tobytes()
    return msg


def _to_proto(body: PassInput, model_id: str, seq_id: int | None, forward_only: bool) -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id or 0, loss_fn=body.loss_fn,
                                    forward_only=forward_only)
    for key, value in (body.loss_fn_config or {}).items():
        msg.loss_fn_config_v2[key].number = value
    for i, datum in enumerate(body.data):
        out = msg.data.add()
        for c, chunk in enumerate(datum.model_input.chunks):
            if chunk.type != "encoded_text" or chunk.tokens is None:
                raise UserError(f"data[{i}].model_input.chunks[{c}]: {chunk.type} chunks are not supported "
                                     "(text models only)")
            try:
                out.model_input.add().encoded_text.tokens = np.asarray(chunk.tokens, np.int32).tobytes()
            except OverflowError:
                raise UserError(f"data[{i}].model_input.chunks[{c}]: a token id does not fit int32") from None
        for key, td in datum.loss_fn_inputs.items():
            out.loss_fn_inputs[key].CopyFrom(_tensor(td, f"data[{i}].loss_fn_inputs[{key!r}]"))
    return msg


def is_json(content_type: str) -> bool:
    return content_type.split(";")[0].strip().lower() == "application/json"


async def decode_pass(body: bytes, content_type: str, forward_route: bool) -> pb.ForwardBackwardRequest:
    """The body of POST /api/v1/forward_backward or /api/v1/forward as a ForwardBackwardRequest message:
    protobuf as sent by SDK >= 0.22, or the JSON of older SDKs converted field by field."""
    if not is_json(content_type):
        msg = await run_in_threadpool(wire.decode_forward_backward, body)
        msg.forward_only = msg.forward_only or forward_route
        return msg
    if forward_route:
        req = await bodies.validate(body, ForwardRequest)
        return await run_in_threadpool(_to_proto, req.forward_input, req.model_id, req.seq_id, True)
    req = await bodies.validate(body, ForwardBackwardRequest)
    return await run_in_threadpool(_to_proto, req.forward_backward_input, req.model_id, req.seq_id, False)
