"""Flows of the official `tinker` SDK against a running server, shared by the SQLite and Postgres tests."""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types as T
from tinker.proto import tinker_public_pb2 as pb

from tests.api.server_proc import API_KEY, CLIENTS

SEQ_LEN = 16


def service(url: str) -> tinker.ServiceClient:
    client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    CLIENTS.setdefault(url, []).append(client)
    return client


def datums(seed: int, rows: int = 4, weights: float = 1.0) -> list[T.Datum]:
    rng = np.random.default_rng(seed)
    seqs = rng.integers(0, 500, (rows, SEQ_LEN + 1))
    return [T.Datum(model_input=T.ModelInput.from_ints(s[:-1].tolist()),
                    loss_fn_inputs={"target_tokens": s[1:].tolist(), "weights": [weights] * SEQ_LEN}) for s in seqs]


def logprobs_of(result) -> np.ndarray:
    return np.stack([np.asarray(out["logprobs"].data, np.float64) for out in result.loss_fn_outputs])


def train_steps(tc, data, steps: int, lr: float = 1e-2) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(T.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def adapter_weights(data_dir: Path, sampler_path: str, tmp: Path) -> dict[str, np.ndarray]:
    """The PEFT tensors of a tinker://<model>/sampler_weights/<name> checkpoint, read from the server's disk."""
    model_id, _, name = sampler_path[len("tinker://"):].split("/")
    out = tmp / f"{model_id.replace(':', '_')}-{name}"
    with tarfile.open(data_dir / "checkpoints" / model_id / "sampler_weights" / f"{name}.tar.gz") as tar:
        tar.extractall(out, filter="data")
    return load_file(next(out.rglob("adapter_model.safetensors")))


def fb_body(model_id: str, seq_id: int, tokens: np.ndarray, forward_only: bool = False,
            loss_fn: str = "cross_entropy") -> bytes:
    """A ForwardBackwardRequest protobuf built by hand (next-token targets, unit weights)."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn, forward_only=forward_only)
    for row in tokens:
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.asarray(row[:-1], np.int32).tobytes()
        n = len(row) - 1
        d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=np.asarray(row[1:], np.int64).tobytes(),
                                                             dtype=pb.DTYPE_INT64, shape=[n]))
        d.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dense=np.ones(n, np.float32).tobytes(),
                                                       dtype=pb.DTYPE_FLOAT32, shape=[n]))
    return msg.SerializeToString()


def full_flow(url: str) -> dict:
    """Every SDK call of the issue, with the checks that make each one meaningful. Returns what a
    restart test needs."""
    sc = service(url)
    caps = tinker.RestClient(base_url=url, api_key=API_KEY).get_server_capabilities().result()
    name = caps.supported_models[0].model_name
    assert caps.supported_models[0].trainable and caps.supported_models[0].max_context_length == 128
    tc = sc.create_lora_training_client(base_model=name, rank=8, seed=0).result()
    info = tc.get_info()
    assert info.is_lora and info.lora_rank == 8 and info.model_data.model_name == name
    data = datums(0)

    losses = train_steps(tc, data, 6)
    assert losses[-1] < 0.8 * losses[0], losses

    fwd = tc.forward(data, "cross_entropy").result()
    lp = logprobs_of(fwd)
    assert lp.shape == (4, SEQ_LEN)
    np.testing.assert_allclose(fwd.metrics["loss:sum"], -lp.sum(), rtol=1e-5)

    def custom(batch, logprobs):
        loss = sum((-x).sum() for x in logprobs)
        return loss, {"custom:sum": float(loss.detach())}

    out = tc.forward_backward_custom(data, custom).result()
    np.testing.assert_allclose(out.metrics["loss:sum"], fwd.metrics["loss:sum"], rtol=1e-5)
    assert "surrogate_loss:sum" in out.metrics and "custom:sum" in out.metrics
    tc.optim_step(T.AdamParams(learning_rate=0.0)).result()  # clears the accumulated custom gradients

    # save_state, one more step as the reference, then both kinds of load
    state = tc.save_state("s1").result().path
    assert state == f"tinker://{info.model_id}/weights/s1"
    train_steps(tc, data, 1)
    after_one = logprobs_of(tc.forward(data, "cross_entropy").result())
    with pytest.warns(FutureWarning):  # deprecated in the SDK, still part of its API
        tc.load_state(state).result()
    np.testing.assert_allclose(logprobs_of(tc.forward(data, "cross_entropy").result()), lp, atol=1e-5)
    train_steps(tc, data, 1)
    fresh_adam = logprobs_of(tc.forward(data, "cross_entropy").result())
    assert np.abs(fresh_adam - after_one).max() > 1e-3  # Adam moments matter
    with pytest.warns(FutureWarning):
        tc.load_state_with_optimizer(state).result()
    train_steps(tc, data, 1)
    np.testing.assert_allclose(logprobs_of(tc.forward(data, "cross_entropy").result()), after_one, atol=1e-5)

    # sampling from a named sampler checkpoint and from an in-memory snapshot of the same weights
    sampler_path = tc.save_weights_for_sampler("s1").result().path
    assert sampler_path == f"tinker://{info.model_id}/sampler_weights/s1"
    snapshot = tc.save_weights_and_get_sampling_client().result()
    named = sc.create_sampling_client(model_path=sampler_path).result()
    prompt_ids = data[0].model_input.to_ints()[:8]
    prompt = T.ModelInput.from_ints(prompt_ids)
    greedy = T.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    a = snapshot.sample(prompt, 1, greedy).result().sequences[0]
    b = named.sample(prompt, 1, greedy).result().sequences[0]
    assert a.tokens == b.tokens and len(a.tokens) == 8 and a.stop_reason == "length"
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)

    res = named.sample(prompt, 3, T.SamplingParams(max_tokens=6, temperature=1.0, seed=7),
                       include_prompt_logprobs=True, topk_prompt_logprobs=2).result()
    assert len(res.sequences) == 3
    for seq in res.sequences:
        assert len(seq.logprobs) == len(seq.tokens) and 1 <= len(seq.tokens) <= 6
    assert len({tuple(s.tokens) for s in res.sequences}) > 1  # seeds differ per sample
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(prompt_ids)
    assert res.topk_prompt_logprobs[0] is None
    for i, row in enumerate(res.topk_prompt_logprobs[1:], start=1):
        assert len(row) == 2 and row[0][1] >= row[1][1] and row[0][1] >= res.prompt_logprobs[i] - 1e-5

    # compute_logprobs == forward on the same tokens with the same weights
    scored = snapshot.compute_logprobs(prompt).result()
    ref = tc.forward([T.Datum(model_input=T.ModelInput.from_ints(prompt_ids[:-1]),
                              loss_fn_inputs={"target_tokens": prompt_ids[1:], "weights": [1.0] * 7})],
                     "cross_entropy").result()
    np.testing.assert_allclose(scored[1:], logprobs_of(ref)[0], atol=1e-4)

    # stop strings: the stop text ends the sequence and is included in it
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(info.model_data.tokenizer_id)
    text = tok.decode(a.tokens)
    stop = tok.decode(a.tokens[3:5])
    assert stop and stop in text
    cut = named.sample(prompt, 2, T.SamplingParams(max_tokens=8, temperature=0.0, stop=[stop])).result()
    for seq in cut.sequences:
        assert seq.stop_reason == "stop" and stop in tok.decode(seq.tokens) and len(seq.tokens) <= 5
    return {"model_id": info.model_id, "state": state, "sampler": sampler_path, "logprobs": lp, "name": name}
