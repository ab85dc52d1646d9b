"""Sampling requests that must not hurt others (issue 12): one tenant's bad request fails alone (11), the
server-side default for max_tokens=None (14), stop strings add to EOS instead of replacing it (15)."""

import json
import shutil
import struct

import numpy as np
import pytest

import tx
from tests.sampling.test_sample import CONFIG, PROMPTS, SP, sample_batch
from tx import types
from tx.checkpoints import storage
from tx.run import backend_config, build_parser
from tx.sampling.requests import stop_list


@pytest.fixture(scope="module")
def backend(tiny_dirs):
    backend = tx.JaxBackend(tiny_dirs["dense"], CONFIG)
    backend.create_model("a", types.LoraConfig(rank=4, seed=1))
    backend.create_model("b", types.LoraConfig(rank=2, seed=2))
    return backend


def _huge_header_tarball(tmp_path):
    """A PEFT tarball whose safetensors header claims 2**62 bytes: reading it raises OverflowError/MemoryError,
    not ValueError."""
    d = tmp_path / "bad"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
    storage.pack_tar(d, tmp_path / "bad.tar.gz")
    return tmp_path / "bad.tar.gz"


def test_one_bad_request_fails_alone(backend, tmp_path):
    """top_k = 2**40 (valid in the SDK), topk_prompt_logprobs beyond the cap and a damaged checkpoint with a
    non-ValueError next to good requests of other adapters: the good ones equal the same requests alone."""
    good = [
        ("g_base", "", [(PROMPTS[0], SP(max_tokens=6, temperature=1.0, seed=11, stop=[]))], True, 3),
        ("g_a", "a", [(PROMPTS[1], SP(max_tokens=7, temperature=0.8, top_k=5, seed=12, stop=[]))] * 2, False, 0),
        ("g_b", "b", [(PROMPTS[2], SP(max_tokens=5, temperature=1.2, top_p=0.9, seed=13, stop=[]))], False, 0),
    ]
    alone = {req[0]: backend.sample(sample_batch([req]))[req[0]] for req in good}
    huge_k = ("huge_top_k", "a", [(PROMPTS[3], SP(max_tokens=6, temperature=1.0, top_k=2**40, seed=5, stop=[]))],
              False, 0)
    bad = [
        ("too_many_topk", "b", [(PROMPTS[0], SP(max_tokens=2))], True, CONFIG.max_topk_prompt_logprobs + 1),
        ("vocab_topk", "", [(PROMPTS[0], SP(max_tokens=2))], True, 10**6),
        ("damaged", "", [(PROMPTS[1], SP(max_tokens=2))], False, 0),
    ]
    batch = sample_batch(good[:2] + [huge_k] + bad + good[2:])
    damaged = _huge_header_tarball(tmp_path)
    start = next(sl[2] for sl in batch.request_batch_slices if sl[0] == "damaged")
    batch.all_checkpoint_paths[start] = str(damaged)
    out = backend.sample(batch)
    for rid, *_ in good:
        assert isinstance(out[rid], types.SampleOutput), out[rid]
        _same(out[rid], alone[rid])
    assert "topk_prompt_logprobs = 21 exceeds this server's limit of 20" in out["too_many_topk"].error
    assert "topk_prompt_logprobs = 1000000 exceeds" in out["vocab_topk"].error
    assert isinstance(out["damaged"], types.ErrorResponse) and str(damaged) in out["damaged"].error
    # top_k beyond the vocabulary keeps every token: the same tokens as no top-k at all
    no_k = ("huge_top_k", "a", [(PROMPTS[3], SP(max_tokens=6, temperature=1.0, top_k=-1, seed=5, stop=[]))], False, 0)
    _same(out["huge_top_k"], backend.sample(sample_batch([no_k]))["huge_top_k"])


def _same(got: types.SampleOutput, want: types.SampleOutput) -> None:
    """Same tokens and stop reasons; log-probs equal up to float noise from other rows' padding."""
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    assert [s.stop_reason for s in got.sequences] == [s.stop_reason for s in want.sequences]
    for g, w in zip(got.sequences, want.sequences):
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
    if want.prompt_logprobs is not None:
        np.testing.assert_allclose(got.prompt_logprobs[1:], want.prompt_logprobs[1:], atol=1e-5)
        assert [[t for t, _ in e] for e in got.topk_prompt_logprobs[1:]] == [
            [t for t, _ in e] for e in want.topk_prompt_logprobs[1:]]


def test_default_max_tokens_caps_unbounded_requests(tiny_dirs):
    backend = tx.JaxBackend(tiny_dirs["dense"], CONFIG.model_copy(update={"default_max_tokens": 5}))
    out = backend.sample(sample_batch([
        ("none", "", [(PROMPTS[0], SP(max_tokens=None, temperature=0.0, stop=[]))], False, 0),
        ("explicit", "", [(PROMPTS[0], SP(max_tokens=9, temperature=0.0, stop=[]))], False, 0),
        ("near_end", "", [(list(range(1, 94)), SP(max_tokens=None, temperature=0.0, stop=[]))], False, 0),
    ]))
    assert len(out["none"].sequences[0].tokens) == 5 and out["none"].sequences[0].stop_reason == "length"
    assert out["none"].sequences[0].tokens == out["explicit"].sequences[0].tokens[:5]
    assert len(out["explicit"].sequences[0].tokens) == 9  # an explicit max_tokens is not capped
    assert len(out["near_end"].sequences[0].tokens) == 3  # only 96 - 93 positions are left
    unlimited = tx.JaxBackend(tiny_dirs["dense"], CONFIG.model_copy(update={"default_max_tokens": 0}))
    out = unlimited.sample(sample_batch([("none", "", [(PROMPTS[0], SP(temperature=0.0, stop=[]))], False, 0)]))
    assert len(out["none"].sequences[0].tokens) == 96 - len(PROMPTS[0])
    assert tx.JaxBackendConfig().default_max_tokens == 1024
    parser = build_parser()
    args = parser.parse_args(["--base-model", "x", "--default-max-tokens", "64", "--max-topk-prompt-logprobs", "5"])
    config = backend_config(args, parser)
    assert (config.default_max_tokens, config.max_topk_prompt_logprobs) == (64, 5)


def test_stop_strings_and_tokens_keep_eos(tiny_dirs, tmp_path):
    """stop=[...] is EOS plus those stops; only stop=[] switches EOS off (Tinker's SamplingParams.stop)."""
    assert stop_list(None, (7,)) == [7] and stop_list([], (7,)) == [] and stop_list(["x"], (7,)) == [7, "x"]
    base = tx.JaxBackend(tiny_dirs["dense"], CONFIG)
    prompt = PROMPTS[2]
    tokens = base.sample(sample_batch([("g", "", [(prompt, SP(max_tokens=12, temperature=0.0, stop=[]))], False, 0)]))
    tokens = tokens["g"].sequences[0].tokens
    eos = tokens[3]
    model_dir = shutil.copytree(tiny_dirs["dense"], tmp_path / "eos")
    gen = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [eos]}))
    backend = tx.JaxBackend(str(model_dir), CONFIG)
    never_token = next(t for t in range(512) if t not in tokens)
    out = backend.sample(sample_batch([
        ("strings", "", [(prompt, SP(max_tokens=12, temperature=0.0, stop=["\n\nUser:"]))], False, 0),
        ("tokens", "", [(prompt, SP(max_tokens=12, temperature=0.0, stop=[never_token]))], False, 0),
        ("off", "", [(prompt, SP(max_tokens=12, temperature=0.0, stop=[]))], False, 0),
    ]))
    at_eos = tokens[: tokens.index(eos) + 1]
    for rid in ("strings", "tokens"):
        assert out[rid].sequences[0].tokens == at_eos and out[rid].sequences[0].stop_reason == "stop", rid
    assert out["off"].sequences[0].tokens == tokens and out["off"].sequences[0].stop_reason == "length"


def test_api_keeps_stop_none_and_empty_apart():
    """The SDK drops None fields on the wire (exclude_none) and sends [] as []: both survive to the backend."""
    from tinker import types as tt
    from tinker._compat import model_dump

    from tx.api import schemas

    for stop, want in [(None, None), ([], []), ("\n", ["\n"]), ([3, 4], [3, 4])]:
        wire = model_dump(tt.SamplingParams(max_tokens=3, stop=stop), exclude_none=True, mode="json")
        body = schemas.SamplingParamsBody(**wire)
        got = [body.stop] if isinstance(body.stop, str) else body.stop
        assert types.SamplingParams(stop=got).stop == want

