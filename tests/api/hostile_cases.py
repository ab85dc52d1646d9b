"""The hostile-input table of tests/api/test_hostile.py: one `Case` per bad request.

Each case is a request a tenant sends against its own model (the "victim") with one bad input. The
expected answer is a 4xx, or an accepted request whose future ends failed, with a message that contains
`field` (one of the alternatives). `seq=True` marks requests that carry a readable model_id and the
victim's next seq_id: refusing them must still consume that seq_id (issue 12, defect 13), so the
victim's next request runs at once instead of waiting for the gap timeout. `may_succeed=True` marks the
few judgment calls where a documented clamp or an idempotent resend is an acceptable answer too; the
reason is in a comment beside the case.

Bodies are built from a `Ctx` (the victim's ids, its next seq_id, a fresh integer); forward_backward
bodies are protobuf `ForwardBackwardRequest`s built with the tinker SDK's own generated classes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field as dc_field
from typing import Any

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

VOCAB = 512  # the tiny model's vocabulary
MAX_SEQ_LEN = 128  # the world's --max-seq-len
MAX_BODY = 2 << 20  # the world's ApiConfig.max_body_bytes
MAX_DECOMPRESSED = 4 << 20  # the world's ApiConfig.max_decompressed_bytes
TOKENS = [5, 17, 33, 101, 250, 7, 9, 400]


@dataclass
class Ctx:
    victim: str  # model id of the attacked model
    session: str  # the attacker's session (it owns victim and twin)
    seq: int  # the victim's next seq_id
    sampler: str  # sampling session over a sampler checkpoint of the victim
    fresh: int  # unused integer (model_seq_id, sampling seq_id)


@dataclass(frozen=True)
class Case:
    id: str
    route: str  # may contain {victim}
    body: Callable[[Ctx], Any]  # dict -> JSON; bytes -> raw body; iterator of bytes -> chunked
    field: tuple[str, ...]  # the message must contain one of these
    seq: bool = False
    may_succeed: bool = False
    method: str = "POST"
    headers: dict[str, str] = dc_field(default_factory=dict)


def raw(obj: Any) -> bytes:
    """JSON where a string "<<lit>>" becomes the bare literal `lit` (1e400, Infinity, huge ints)."""
    return json.dumps(obj).replace('"<<', "").replace('>>"', "").encode()


# ---- protobuf forward_backward bodies ----

_NP = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def tensor(values, dtype=pb.DTYPE_FLOAT32, shape=None, dense: bytes | None = None) -> pb.Tensor:
    data = dense if dense is not None else np.asarray(values, _NP.get(dtype, np.float32)).tobytes()
    return pb.Tensor(dense=data, dtype=dtype, shape=[len(values)] if shape is None else list(shape))


def sparse(shape, crow, col, values) -> pb.Tensor:
    csr = pb.SparseCsr(values=np.asarray(values, np.float32).tobytes(),
                       crow_indices=np.asarray(crow, np.int64).tobytes(),
                       col_indices=np.asarray(col, np.int64).tobytes())
    return pb.Tensor(sparse_csr=csr, dtype=pb.DTYPE_FLOAT32, shape=list(shape))


def datum(tokens=TOKENS, targets=None, **inputs) -> pb.Datum:
    """A datum with next-token targets; `inputs` are extra loss_fn_inputs (lists or ready Tensors)."""
    d = pb.Datum()
    d.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
    targets = list(tokens[1:]) + [0] if targets is None else targets
    inputs = {"target_tokens": tensor(targets, pb.DTYPE_INT64), **inputs}
    for key, value in inputs.items():
        d.loss_fn_inputs[key].CopyFrom(value if isinstance(value, pb.Tensor) else tensor(value))
    return d


def fb(c: Ctx, *datums: pb.Datum, loss_fn="cross_entropy", config=None, text_config=None, seq=None,
       model=None, forward_only=False) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=c.victim if model is None else model, seq_id=c.seq if seq is None else seq,
                                    loss_fn=loss_fn, forward_only=forward_only)
    msg.data.extend(datums or [datum()])
    for key, value in (config or {}).items():
        msg.loss_fn_config[key] = value
    for key, value in (text_config or {}).items():
        msg.loss_fn_config_v2[key].text = value
    return msg.SerializeToString()


def ones(value=1.0, n=len(TOKENS)) -> list[float]:
    return [value] * n


def rl(c: Ctx, loss_fn: str, config=None, **inputs) -> bytes:
    """An RL datum (sampling logprobs and advantages) with the given inputs overridden."""
    base = {"logprobs": ones(-2.0), "advantages": ones(0.5), **inputs}
    return fb(c, datum(**base), loss_fn=loss_fn, config=config)


def without_targets(c: Ctx) -> bytes:
    d = datum()
    del d.loss_fn_inputs["target_tokens"]
    return fb(c, d)


def with_image(c: Ctx) -> bytes:
    d = datum()
    d.model_input.add().image.CopyFrom(pb.ImageChunk(data=b"x", format="png"))
    return fb(c, d)


def zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


# ---- JSON bodies ----


def create(c: Ctx, **over) -> dict:
    lora = over.pop("lora_config", {"rank": 4})
    return {"session_id": c.session, "model_seq_id": c.fresh, "base_model": "tiny", "lora_config": lora, **over}


def optim(c: Ctx, **adam) -> dict:
    return {"model_id": c.victim, "seq_id": c.seq, "adam_params": {"learning_rate": 1e-3, **adam}}


def sample(c: Ctx, params=None, tokens=(1, 2, 3), **top) -> dict:
    return {"sampling_session_id": c.sampler, "seq_id": c.fresh, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(tokens)}]},
            "sampling_params": {"max_tokens": 4, **(params or {})}, **top}


def save(c: Ctx, path="ok-name", **over) -> dict:
    return {"model_id": c.victim, "seq_id": c.seq, "path": path, **over}


def load(c: Ctx, path: str) -> dict:
    return {"model_id": c.victim, "seq_id": c.seq, "path": path, "optimizer": True}


def bomb(_c: Ctx) -> bytes:
    return zstd(b"\0" * (MAX_DECOMPRESSED * 4))


def chunked(_c: Ctx):
    """A body over the size limit sent without Content-Length (chunked), so only streaming catches it."""
    yield b'{"tags": ["'
    for _ in range(MAX_BODY // 65536 + 2):
        yield b"a" * 65536
    yield b'"]}'


def nested(_c: Ctx) -> bytes:
    depth = 100_000
    return b'{"tags": [], "user_metadata": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"


FB, OPT, SAMPLE, CREATE = "/api/v1/forward_backward", "/api/v1/optim_step", "/api/v1/asample", "/api/v1/create_model"
SAVE, SAVE_SAMPLER, LOAD = "/api/v1/save_weights", "/api/v1/save_weights_for_sampler", "/api/v1/load_weights"
TTL = "/api/v1/training_runs/{victim}/checkpoints/weights/ttl-target/ttl"
PROTO = {"Content-Type": "application/x-protobuf"}
BIG = 2**31

CREATE_CASES = [
    Case("create-rank-0", CREATE, lambda c: create(c, lora_config={"rank": 0}), ("rank",)),
    Case("create-rank-negative", CREATE, lambda c: create(c, lora_config={"rank": -1}), ("rank",)),
    Case("create-rank-over-max", CREATE, lambda c: create(c, lora_config={"rank": 4096}), ("rank",)),
    Case("create-rank-string", CREATE, lambda c: create(c, lora_config={"rank": "8; drop"}), ("rank",)),
    Case("create-seed-huge", CREATE, lambda c: create(c, lora_config={"rank": 4, "seed": 2**80}), ("seed",)),
    Case("create-train-nothing", CREATE, lambda c: create(c, lora_config={
        "rank": 4, "train_attn": False, "train_mlp": False, "train_unembed": False}), ("train_",)),
    Case("create-bad-base-model", CREATE, lambda c: create(c, base_model="../../etc/passwd"), ("base_model",)),
    Case("create-unknown-optimizer", CREATE, lambda c: create(c, optimizer_config={"type": "sgd"}), ("optimizer",)),
    Case("create-unknown-session", CREATE, lambda c: create(c, session_id="no-such-session"), ("session",)),
    Case("create-model-seq-id-negative", CREATE, lambda c: create(c, model_seq_id=-1), ("model_seq_id",)),
    # model_seq_id 0 is the victim itself, here with another rank. A resend with the same key is the
    # SDK's retry and answers the original future: acceptable, as long as nothing changes.
    Case("create-duplicate-model-seq-id", CREATE, lambda c: create(c, model_seq_id=0, lora_config={"rank": 2}),
         ("model_seq_id",), may_succeed=True),
]

FB_CASES = [
    Case("fb-token-out-of-vocab", FB, lambda c: fb(c, datum([1, 2, VOCAB, 4])), ("model_input",), seq=True),
    Case("fb-token-negative", FB, lambda c: fb(c, datum([1, -5, 3, 4])), ("model_input",), seq=True),
    Case("fb-target-out-of-vocab", FB, lambda c: fb(c, datum([1, 2, 3], targets=[2, 3, 10**12])),
         ("target_tokens",), seq=True),
    Case("fb-second-datum-bad", FB, lambda c: fb(c, datum(), datum([1, 2, VOCAB + 7])), ("model_input",), seq=True),
    Case("fb-targets-length-mismatch", FB, lambda c: fb(c, datum([1, 2, 3, 4], targets=[2, 3])),
         ("target_tokens",), seq=True),
    Case("fb-weights-length-mismatch", FB, lambda c: fb(c, datum(weights=[1.0, 1.0])), ("weights",), seq=True),
    Case("fb-empty-datum", FB, lambda c: fb(c, datum([], targets=[])), ("data[0]", "datum 0"), seq=True),
    Case("fb-no-data", FB, lambda c: pb.ForwardBackwardRequest(model_id=c.victim, seq_id=c.seq,
                                                               loss_fn="cross_entropy").SerializeToString(),
         ("data",), seq=True),
    Case("fb-too-long", FB, lambda c: fb(c, datum(list(range(MAX_SEQ_LEN + 72)))), ("max_seq_len",), seq=True),
    Case("fb-weights-nan", FB, lambda c: fb(c, datum(weights=ones(float("nan")))), ("weights",), seq=True),
    Case("fb-weights-inf", FB, lambda c: fb(c, datum(weights=ones(float("inf")))), ("weights",), seq=True),
    Case("fb-weights-3e38", FB, lambda c: fb(c, datum(weights=ones(3e38))), ("weights",), seq=True),
    Case("fb-logprobs-nan", FB, lambda c: rl(c, "importance_sampling", logprobs=ones(float("nan"))),
         ("logprobs",), seq=True),
    Case("fb-logprobs-minus-3e38", FB, lambda c: rl(c, "ppo", logprobs=ones(-3e38)), ("logprobs",), seq=True),
    Case("fb-unknown-loss", FB, lambda c: fb(c, loss_fn="evil_loss"), ("loss_fn",), seq=True),
    Case("fb-unknown-config-key", FB, lambda c: fb(c, config={"sneaky": 1.0}), ("sneaky",), seq=True),
    Case("fb-dro-beta-1e300", FB, lambda c: rl(c, "dro", config={"beta": 1e300}), ("beta",), seq=True),
    Case("fb-ppo-clip-nan", FB, lambda c: rl(c, "ppo", config={"clip_low_threshold": float("nan")}),
         ("clip_low_threshold",), seq=True),
    Case("fb-config-text-value", FB, lambda c: fb(c, text_config={"beta": "lots"}), ("loss_fn_config",), seq=True),
    Case("fb-shape-2e32-squared", FB, lambda c: fb(c, datum(weights=tensor([], shape=[2**32, 2**32]))),
         ("weights",), seq=True),
    Case("fb-shape-negative", FB, lambda c: fb(c, datum(weights=tensor(ones(1.0, 4), shape=[-1, -4]))),
         ("weights",), seq=True),
    Case("fb-sparse-1x1e13", FB, lambda c: fb(c, datum(weights=sparse([1, 10**13], [0, 1], [5], [1.0]))),
         ("weights",), seq=True),
    Case("fb-sparse-bad-indices", FB, lambda c: fb(c, datum(weights=sparse([1, 8], [0, 3], [1, 9, 2], [1, 1, 1]))),
         ("weights",), seq=True),
    Case("fb-wrong-dtype", FB, lambda c: fb(c, datum(weights=tensor(ones(), dtype=99))), ("weights",), seq=True),
    Case("fb-bfloat16-dtype", FB, lambda c: fb(c, datum(weights=tensor(ones(), dtype=pb.DTYPE_BFLOAT16))),
         ("weights",), seq=True),
    Case("fb-ragged-bytes", FB, lambda c: fb(c, datum(weights=tensor(ones(), dense=b"\0" * 5))), ("weights",),
         seq=True),
    Case("fb-2d-weights", FB, lambda c: fb(c, datum(weights=tensor(ones(), shape=[2, 4]))), ("weights",), seq=True),
    Case("fb-missing-target-tokens", FB, without_targets, ("target_tokens",), seq=True),
    Case("fb-image-chunk", FB, with_image, ("chunks",), seq=True),
    Case("fb-seq-id-zero", FB, lambda c: fb(c, seq=0), ("seq_id",)),
    Case("fb-seq-id-negative", FB, lambda c: fb(c, seq=-3), ("seq_id",)),
    # seq_id 1 was used by the victim's first forward_backward: the SDK's retry of a request re-sends its
    # seq_id, so answering the original future (other tokens, yet nothing runs again) is the protocol;
    # refusing it is fine too.
    Case("fb-seq-id-already-used", FB, lambda c: fb(c, datum([9, 8, 7, 6]), seq=1), ("seq_id",), may_succeed=True),
    Case("fb-unknown-model", FB, lambda c: fb(c, model="nobody:train:0", seq=1), ("model_id",)),
    Case("fb-malformed-protobuf", FB, lambda c: b"\xff\xff\xff\xff\x0f" + fb(c),
         ("protobuf", "ForwardBackwardRequest")),
]

OPT_CASES = [
    Case("optim-lr-infinity", OPT, lambda c: raw(optim(c, learning_rate="<<Infinity>>")), ("learning_rate",), seq=True),
    Case("optim-lr-1e39", OPT, lambda c: optim(c, learning_rate=1e39), ("learning_rate",), seq=True),
    Case("optim-lr-negative", OPT, lambda c: optim(c, learning_rate=-1.0), ("learning_rate",), seq=True),
    Case("optim-lr-nan", OPT, lambda c: raw(optim(c, learning_rate="<<NaN>>")), ("learning_rate",), seq=True),
    Case("optim-lr-string", OPT, lambda c: optim(c, learning_rate="fast"), ("learning_rate",), seq=True),
    Case("optim-weight-decay-1e39", OPT, lambda c: optim(c, weight_decay=1e39), ("weight_decay",), seq=True),
    Case("optim-eps-1e-46", OPT, lambda c: optim(c, eps=1e-46), ("eps",), seq=True),
    Case("optim-eps-0", OPT, lambda c: optim(c, eps=0.0), ("eps",), seq=True),
    Case("optim-beta1-1.5", OPT, lambda c: optim(c, beta1=1.5), ("beta1",), seq=True),
    Case("optim-beta2-negative", OPT, lambda c: optim(c, beta2=-0.1), ("beta2",), seq=True),
    Case("optim-beta2-one", OPT, lambda c: optim(c, beta2=1.0), ("beta2",), seq=True),
    Case("optim-grad-clip-nan", OPT, lambda c: raw(optim(c, grad_clip_norm="<<NaN>>")), ("grad_clip_norm",), seq=True),
    Case("optim-grad-clip-negative", OPT, lambda c: optim(c, grad_clip_norm=-1.0), ("grad_clip_norm",), seq=True),
    Case("optim-missing-adam-params", OPT, lambda c: {"model_id": c.victim, "seq_id": c.seq}, ("adam_params",),
         seq=True),
    Case("optim-adam-params-not-object", OPT, lambda c: {"model_id": c.victim, "seq_id": c.seq, "adam_params": "x"},
         ("adam_params",), seq=True),
    Case("optim-unknown-field-with-bad-lr", OPT, lambda c: {**optim(c, learning_rate=-5.0), "evil": {"lr": 1}},
         ("learning_rate",), seq=True),
    Case("optim-unknown-model", OPT, lambda c: {**optim(c), "model_id": "nobody:train:0"}, ("model_id",)),
]

SAMPLE_CASES = [
    # top_k beyond the vocabulary (the SDK allows any int): clamping to the vocabulary is as good as refusing
    Case("sample-top-k-2e31", SAMPLE, lambda c: sample(c, {"top_k": BIG}), ("top_k",), may_succeed=True),
    Case("sample-top-k-2e40", SAMPLE, lambda c: sample(c, {"top_k": 2**40}), ("top_k",), may_succeed=True),
    Case("sample-top-k-2e70", SAMPLE, lambda c: sample(c, {"top_k": 2**70}), ("top_k",), may_succeed=True),
    Case("sample-top-k-negative", SAMPLE, lambda c: sample(c, {"top_k": -5}), ("top_k",)),
    Case("sample-topk-prompt-logprobs-over-vocab", SAMPLE, lambda c: sample(
        c, prompt_logprobs=True, topk_prompt_logprobs=VOCAB + 1), ("topk_prompt_logprobs",)),
    Case("sample-topk-prompt-logprobs-2e31", SAMPLE, lambda c: sample(
        c, prompt_logprobs=True, topk_prompt_logprobs=BIG), ("topk_prompt_logprobs",)),
    Case("sample-num-samples-0", SAMPLE, lambda c: sample(c, num_samples=0), ("num_samples",)),
    Case("sample-num-samples-huge", SAMPLE, lambda c: sample(c, num_samples=10**9), ("num_samples",)),
    # zero new tokens is a well-defined (empty) answer; refusing it is fine too
    Case("sample-max-tokens-0", SAMPLE, lambda c: sample(c, {"max_tokens": 0}), ("max_tokens",), may_succeed=True),
    Case("sample-max-tokens-negative", SAMPLE, lambda c: sample(c, {"max_tokens": -1}), ("max_tokens",)),
    Case("sample-max-tokens-huge", SAMPLE, lambda c: sample(c, {"max_tokens": 2**40}), ("max_tokens",)),
    Case("sample-max-tokens-float", SAMPLE, lambda c: sample(c, {"max_tokens": 1.5}), ("max_tokens",)),
    Case("sample-temperature-negative", SAMPLE, lambda c: sample(c, {"temperature": -1.0}), ("temperature",)),
    Case("sample-temperature-nan", SAMPLE, lambda c: raw(sample(c, {"temperature": "<<NaN>>"})), ("temperature",)),
    Case("sample-temperature-1e39", SAMPLE, lambda c: sample(c, {"temperature": 1e39}), ("temperature",)),
    Case("sample-top-p-over-1", SAMPLE, lambda c: sample(c, {"top_p": 1.5}), ("top_p",)),
    Case("sample-top-p-zero", SAMPLE, lambda c: sample(c, {"top_p": 0.0}), ("top_p",)),
    Case("sample-empty-prompt", SAMPLE, lambda c: sample(c, tokens=()), ("prompt",)),
    Case("sample-no-chunks", SAMPLE, lambda c: {**sample(c), "prompt": {"chunks": []}}, ("prompt",)),
    Case("sample-prompt-out-of-vocab", SAMPLE, lambda c: sample(c, tokens=(1, 10**6)), ("prompt",)),
    Case("sample-prompt-negative", SAMPLE, lambda c: sample(c, tokens=(-1, 2)), ("prompt",)),
    Case("sample-prompt-too-long", SAMPLE, lambda c: sample(c, tokens=[3] * (MAX_SEQ_LEN + 1)),
         ("prompt", "max_seq_len")),
    Case("sample-last-n-zero", SAMPLE, lambda c: sample(c, prompt_logprobs=True, prompt_logprobs_last_n=0),
         ("prompt_logprobs_last_n",)),
    Case("sample-last-n-huge", SAMPLE, lambda c: sample(c, prompt_logprobs=True, prompt_logprobs_last_n=10**6),
         ("prompt_logprobs_last_n",)),
    Case("sample-unknown-session", SAMPLE, lambda c: {**sample(c), "sampling_session_id": "nobody:sample:0"},
         ("sampling_session_id",)),
    Case("sample-model-path-traversal", SAMPLE, lambda c: {
        **{k: v for k, v in sample(c).items() if k != "sampling_session_id"},
        "model_path": "tinker://../../etc/sampler_weights/passwd"}, ("model_path",)),
    Case("sample-model-path-missing", SAMPLE, lambda c: {
        **{k: v for k, v in sample(c).items() if k != "sampling_session_id"},
        "model_path": f"tinker://{c.victim}/sampler_weights/never-saved"}, ("model_path",)),
    # stop strings are matched on the host (cost linear in the list, bounded by the body limit): serving
    # them is acceptable, so is a cap that refuses
    Case("sample-stop-huge-list", SAMPLE, lambda c: sample(c, {"stop": [f"stop-{i}" for i in range(50_000)]}),
         ("stop",), may_succeed=True),
    Case("sample-stop-token-out-of-vocab", SAMPLE, lambda c: sample(c, {"stop": [VOCAB + 3]}), ("stop",)),
    Case("sample-stop-empty-string", SAMPLE, lambda c: sample(c, {"stop": [""]}), ("stop",)),
    # any integer seed can be reduced to the device's seed width (documented: seed + i modulo 2**32)
    Case("sample-seed-huge", SAMPLE, lambda c: sample(c, {"seed": 2**70}), ("seed",), may_succeed=True),
]

CHECKPOINT_CASES = [
    Case("save-name-dotdot", SAVE, lambda c: save(c, "../../escape"), ("path",), seq=True),
    Case("save-name-slash", SAVE, lambda c: save(c, "a/b"), ("path",), seq=True),
    Case("save-name-absolute", SAVE, lambda c: save(c, "/etc/passwd"), ("path",), seq=True),
    Case("save-name-empty", SAVE, lambda c: save(c, ""), ("path",), seq=True),
    Case("save-name-huge", SAVE, lambda c: save(c, "a" * 10_000), ("path",), seq=True),
    Case("save-ttl-1e400", SAVE, lambda c: raw(save(c, ttl_seconds="<<1e400>>")), ("ttl_seconds",), seq=True),
    Case("save-ttl-10e400-int", SAVE, lambda c: raw(save(c, ttl_seconds=f"<<{10**400}>>")), ("ttl_seconds",), seq=True),
    Case("save-ttl-negative", SAVE, lambda c: save(c, ttl_seconds=-5), ("ttl_seconds",), seq=True),
    Case("sampler-save-name-dotdot", SAVE_SAMPLER, lambda c: save(c, ".."), ("path",), seq=True),
    Case("load-nonexistent", LOAD, lambda c: load(c, f"tinker://{c.victim}/weights/never-saved"), ("path",), seq=True),
    Case("load-traversal", LOAD, lambda c: load(c, f"tinker://{c.victim}/weights/../../../etc"), ("path",), seq=True),
    Case("load-wrong-kind", LOAD, lambda c: load(c, f"tinker://{c.victim}/sampler_weights/smp"), ("path",), seq=True),
    Case("load-not-tinker-url", LOAD, lambda c: load(c, "file:///etc/passwd"), ("path",), seq=True),
    Case("create-from-state-traversal", LOAD, lambda c: {"session_id": c.session, "model_seq_id": c.fresh,
                                                           "path": "tinker://..%2f..:train:0/weights/x"}, ("path",)),
    Case("ttl-1e400", TTL, lambda c: raw({"ttl_seconds": "<<1e400>>"}), ("ttl_seconds",), method="PUT"),
    Case("ttl-10e400-int", TTL, lambda c: raw({"ttl_seconds": f"<<{10**400}>>"}), ("ttl_seconds",), method="PUT"),
    Case("ttl-negative", TTL, lambda c: {"ttl_seconds": -1}, ("ttl_seconds",), method="PUT"),
    # a bare ".." segment is resolved away by the HTTP client; "a..b" reaches the route
    Case("delete-checkpoint-dotdot", "/api/v1/training_runs/{victim}/checkpoints/weights/a..b", lambda c: None,
         ("a..b",), method="DELETE"),
    Case("weights-info-traversal", "/api/v1/weights_info", lambda c: {"tinker_path": "tinker://a/../../b"},
         ("tinker_path",)),
    Case("sampling-session-traversal", "/api/v1/create_sampling_session", lambda c: {
        "session_id": c.session, "sampling_session_seq_id": c.fresh, "model_path": "tinker://x/../sampler_weights/y"},
         ("model_path",)),
]

WIRE_CASES = [
    Case("wire-bad-zstd", FB, lambda c: b"\x28\xb5\x2f\xfd" + b"garbage" * 10, ("zstd",),
         headers={**PROTO, "Content-Encoding": "zstd"}),
    Case("wire-zstd-bomb", FB, bomb, ("decompressed",), headers={**PROTO, "Content-Encoding": "zstd"}),
    Case("wire-gzip-encoding", FB, lambda c: b"\x1f\x8b" + fb(c), ("Content-Encoding",),
         headers={**PROTO, "Content-Encoding": "gzip"}),
    Case("wire-body-too-large", "/api/v1/create_session", lambda c: {"tags": ["a" * MAX_BODY]}, ("limit",)),
    Case("wire-body-too-large-chunked", "/api/v1/create_session", chunked, ("limit",)),
    Case("wire-json-array", OPT, lambda c: b"[1, 2, 3]", ("body", "object")),
    Case("wire-json-truncated", OPT, lambda c: b'{"model_id": ', ("JSON", "json")),
    Case("wire-json-not-utf8", OPT, lambda c: b'{"model_id": "\xff\xfe"}', ("utf", "UTF", "JSON")),
    Case("wire-json-deeply-nested", "/api/v1/create_session", nested, ("user_metadata", "recursion", "JSON")),
    Case("wire-json-for-protobuf-route", FB, lambda c: {"model_id": c.victim, "seq_id": c.seq},
         ("protobuf", "ForwardBackwardRequest")),
    Case("wire-protobuf-for-json-route", OPT, lambda c: fb(c), ("JSON", "json", "body"), headers=PROTO),
    # unknown fields are ignored, as Tinker's own schemas do (newer SDKs send fields tx does not know)
    Case("wire-sample-unknown-field", SAMPLE, lambda c: {**sample(c), "evil_field": {"x": [1] * 100}}, ("evil_field",),
         may_succeed=True),
]

CASES = CREATE_CASES + FB_CASES + OPT_CASES + SAMPLE_CASES + CHECKPOINT_CASES + WIRE_CASES
