"""JaxBackend.sample: greedy parity with transformers generate (base and LoRA via PEFT; with a repetition
penalty), sampled-token log-probs vs forward, min-p support, prompt log-probs, seeds, stops, compile counts, bad
parameters."""

import json
import shutil

import numpy as np
import pytest
import torch
from peft import LoraConfig as PeftLoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import tx
from tests.helpers import make_batch, peft_weights
from tx import types
from tx.models.adapters import set_adapter_weights

SP = types.SamplingParams
# the paged engine, the only one (also checked against the tests' oracle: tests/sampling/test_paged_engine.py)
CONFIG = tx.JaxBackendConfig(max_lora_adapters=4, max_lora_rank=8, max_seq_len=96, max_num_samples=8)
PROMPTS = [[5, 17, 99, 3], [42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [300]]


def sample_batch(requests):
    """[(request_id, model_id, [(prompt, params), ...], prompt_logprobs, topk)] -> PreparedSampleBatch."""
    prompts, params, models, slices = [], [], [], []
    for request_id, model_id, rows, want_lp, topk in requests:
        start = len(prompts)
        for prompt, p in rows:
            prompts.append(list(prompt))
            params.append(p)
            models.append(model_id)
        slices.append((request_id, model_id, start, len(prompts), want_lp, topk))
    return types.PreparedSampleBatch(all_prompts=prompts, all_sampling_params=params, all_model_ids=models,
                                     all_checkpoint_ids=[""] * len(prompts), all_checkpoint_paths=[""] * len(prompts),
                                     request_batch_slices=slices)


@pytest.fixture(scope="module")
def peft_backend(tiny_dirs):
    """Backend whose adapter "a" holds the random weights of a PEFT model (returned alongside)."""
    backend = tx.JaxBackend(tiny_dirs["moe"], CONFIG)
    backend.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs["moe"], dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]
    peft = get_peft_model(base, PeftLoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    for module in peft.modules():  # larger B so the adapter visibly changes greedy outputs
        if hasattr(module, "lora_B") and "default" in module.lora_B:
            with torch.no_grad():
                module.lora_B["default"].weight.mul_(20.0)
    set_adapter_weights(backend.model, backend.models["a"].adapter_index, peft_weights(peft), alpha=8, rank=4)
    return backend, peft


def test_greedy_matches_transformers_generate(tiny_dirs, peft_backend):
    backend, peft = peft_backend
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["moe"], dtype=torch.float32)
    greedy = [SP(max_tokens=m, temperature=0.0, stop=[]) for m in (10, 6, 12, 3)]
    requests = [(f"{model}{i}", model, [(p, g)], False, 0) for model in ("", "a") for i, (p, g) in enumerate(zip(PROMPTS, greedy))]
    out = backend.sample(sample_batch(requests))
    differs = 0
    for (request_id, model_id, [(prompt, params)], _, _) in requests:
        ref_model = peft if model_id else hf
        ids = ref_model.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        seq = out[request_id].sequences[0]
        assert seq.tokens == ids, request_id
        assert seq.stop_reason == "length"
        differs += model_id == "a" and ids != out[request_id.replace("a", "", 1)].sequences[0].tokens
    assert differs >= 2  # the adapter changes the continuation


def test_sampled_logprobs_equal_forward_and_prompt_logprobs(tiny_dirs, peft_backend):
    backend, _ = peft_backend
    params = [SP(max_tokens=9, temperature=1.0, seed=1), SP(max_tokens=7, temperature=0.7, top_k=20, seed=2),
              SP(max_tokens=8, temperature=1.3, top_p=0.8, seed=3), SP(max_tokens=5, temperature=0.0, stop=[])]
    requests = [(f"r{i}", ["", "a"][i % 2], [(p, sp)], True, 5) for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    out = backend.sample(sample_batch(requests))
    backend.create_model("z", types.LoraConfig(rank=1, seed=0))  # a fresh adapter (B = 0) is the base model
    fwd_requests = []
    for request_id, model_id, [(prompt, _)], _, _ in requests:
        full = prompt + out[request_id].sequences[0].tokens
        fwd_requests.append((request_id, model_id or "z", [{"input_ids": full[:-1], "targets": full[1:]}], "cross_entropy", None))
    fwd = backend.forward(make_batch(fwd_requests))
    backend.delete_model("z")
    for request_id, _, [(prompt, _)], _, _ in requests:
        seq = out[request_id].sequences[0]
        teacher = fwd[request_id].loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(seq.logprobs, teacher[len(prompt) - 1:], atol=1e-4)
        prompt_lp = out[request_id].prompt_logprobs
        assert prompt_lp[0] is None and len(prompt_lp) == len(prompt)
        np.testing.assert_allclose(prompt_lp[1:], teacher[: len(prompt) - 1], atol=1e-4)
    # top-k prompt log-probs are the top-k of the full next-token distribution
    model_out = out["r1"]
    logits = backend.model.logits(_hidden(backend, PROMPTS[1], "a"), np.array([backend.models["a"].adapter_index]))
    full = np.asarray(torch.log_softmax(torch.tensor(np.asarray(logits[0])), -1))
    for pos, entries in enumerate(model_out.topk_prompt_logprobs[1:]):
        want = np.argsort(-full[pos])[:5]
        assert [t for t, _ in entries] == want.tolist()
        np.testing.assert_allclose([v for _, v in entries], full[pos, want], atol=1e-5)


def _hidden(backend, prompt, model_id):
    ids = np.array([prompt])
    return backend.model(ids, np.ones_like(ids), np.array([backend.models[model_id].adapter_index]))


def test_seeds_are_per_row_and_batch_independent(peft_backend):
    backend, _ = peft_backend
    p = SP(max_tokens=12, temperature=1.0, seed=7)
    alone = backend.sample(sample_batch([("x", "a", [(PROMPTS[0], p)], False, 0)]))["x"].sequences[0].tokens
    crowd = backend.sample(sample_batch([
        ("long", "", [(PROMPTS[2], SP(max_tokens=30, temperature=0.5))], False, 0),
        ("x", "a", [(PROMPTS[0], p)], False, 0),
        ("many", "a", [(PROMPTS[0], SP(max_tokens=12, temperature=1.0, seed=7))] * 4, False, 0),
    ]))
    assert crowd["x"].sequences[0].tokens == alone  # different batch, padding and row position
    samples = [s.tokens for s in crowd["many"].sequences]
    assert samples[0] == alone  # sample i uses seed + i
    assert len({tuple(s) for s in samples}) == 4  # num_samples samples differ
    other = backend.sample(sample_batch([("y", "a", [(PROMPTS[0], SP(max_tokens=12, temperature=1.0, seed=8))], False, 0)]))
    assert other["y"].sequences[0].tokens != alone and other["y"].sequences[0].tokens == samples[1]


def test_top_k_one_is_greedy_and_compiles_stay_fixed(tiny_dirs):
    backend = tx.JaxBackend(tiny_dirs["dense"], CONFIG)
    backend.create_model("a", types.LoraConfig(rank=4, seed=0))
    greedy = backend.sample(sample_batch([("g", "a", [(PROMPTS[0], SP(max_tokens=10, temperature=0.0, stop=[]))], False, 0)]))
    variants = [SP(max_tokens=10, temperature=t, top_k=1, seed=s, stop=[]) for t, s in [(0.5, 1), (1.5, 2), (3.0, 3)]]
    variants += [SP(max_tokens=m, temperature=0.9, top_k=k, top_p=tp, seed=4, stop=stop)
                 for m, k, tp, stop in [(12, 5, 0.9, [7]), (14, -1, 0.5, [3, 4, 5]), (9, 50, 1.0, ["ab"])]]
    outs = [backend.sample(sample_batch([("v", "a", [(PROMPTS[0], v)], False, 0)]))["v"] for v in variants]
    for o in outs[:3]:
        assert o.sequences[0].tokens == greedy["g"].sequences[0].tokens
    programs = {k: v for k, v in backend.metrics.compiles.items() if k.startswith("sample")}
    # 7 calls, one prefill and one decode program: all values vary within buckets (the row with a stop string
    # adds the decode program that also matches stop sequences on the device)
    assert programs == {"sample_prefill": 1, "sample_decode": 2}, programs


def test_stop_tokens_strings_and_eos(tiny_dirs, tmp_path):
    backend = tx.JaxBackend(tiny_dirs["dense"], CONFIG)
    prompt = PROMPTS[2]
    base = backend.sample(sample_batch([("g", "", [(prompt, SP(max_tokens=12, temperature=0.0, stop=[]))], False, 0)]))
    tokens = base["g"].sequences[0].tokens
    stop_token = tokens[4]
    first = tokens.index(stop_token)
    out = backend.sample(sample_batch([("t", "", [(prompt, SP(max_tokens=12, temperature=0.0, stop=[999 % 512, stop_token]))], False, 0)]))
    seq = out["t"].sequences[0]
    assert seq.tokens == tokens[: first + 1] and seq.stop_reason == "stop"
    text = backend.sampler.decode_text(tokens)
    piece = backend.sampler.decode_text(tokens[5:7])
    out = backend.sample(sample_batch([("s", "", [(prompt, SP(max_tokens=12, temperature=0.0, stop=[piece]))], False, 0)]))
    seq = out["s"].sequences[0]
    decoded = backend.sampler.decode_text(seq.tokens)
    assert piece in decoded and piece not in backend.sampler.decode_text(seq.tokens[:-1])
    assert seq.stop_reason == "stop" and text.startswith(decoded)
    # EOS: a model whose eos_token_id is the 4th greedy token stops there by default, not with stop=[]
    model_dir = shutil.copytree(tiny_dirs["dense"], tmp_path / "eos")
    gen = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [tokens[3]]}))
    eos_backend = tx.JaxBackend(str(model_dir), CONFIG)
    out = eos_backend.sample(sample_batch([
        ("default", "", [(prompt, SP(max_tokens=12, temperature=0.0))], False, 0),
        ("never", "", [(prompt, SP(max_tokens=12, temperature=0.0, stop=[]))], False, 0),
    ]))
    assert out["default"].sequences[0].tokens == tokens[: tokens.index(tokens[3]) + 1]
    assert out["default"].sequences[0].stop_reason == "stop"
    assert out["never"].sequences[0].tokens == tokens and out["never"].sequences[0].stop_reason == "length"


def test_bad_parameters_fail_alone_and_rows_wait_for_slots(tiny_dirs):
    backend = tx.JaxBackend(tiny_dirs["dense"], CONFIG.model_copy(update={"max_num_seqs": 2}))
    good = ("good", "", [(PROMPTS[0], SP(max_tokens=4, temperature=0.0, stop=[]))] * 3, False, 0)
    bad = {
        "neg_max_tokens": ([(PROMPTS[0], SP(max_tokens=-2))], "max_tokens = -2 must be >= 0"),
        "top_p_zero": ([(PROMPTS[0], SP(top_p=0.0))], "top_p = 0.0 must be in (0, 1]"),
        "top_p_big": ([(PROMPTS[0], SP(top_p=1.5))], "top_p = 1.5 must be in (0, 1]"),
        "neg_temperature": ([(PROMPTS[0], SP(temperature=-0.1))], "temperature = -0.1"),
        "too_many": ([(PROMPTS[0], SP(max_tokens=2))] * 9, "num_samples = 9 exceeds max_num_samples=8"),
        "too_long": ([(list(range(90)), SP(max_tokens=10))], "exceeds max_seq_len=96"),
        "bad_token": ([([1, 600], SP(max_tokens=2))], "prompt[1] = 600 is outside the vocabulary"),
        "unknown_model": ([(PROMPTS[0], SP(max_tokens=2))], "unknown model_id 'ghost'"),
        "min_p_neg": ([(PROMPTS[0], SP(min_p=-0.1))], "min_p = -0.1 must be in [0, 1]"),
        "min_p_big": ([(PROMPTS[0], SP(min_p=1.5))], "min_p = 1.5 must be in [0, 1]"),
        "min_p_nan": ([(PROMPTS[0], SP(min_p=float("nan")))], "min_p = nan must be in [0, 1]"),
        "penalty_zero": ([(PROMPTS[0], SP(repetition_penalty=0.0))], "repetition_penalty = 0.0 must be"),
        "penalty_neg": ([(PROMPTS[0], SP(repetition_penalty=-1.2))], "repetition_penalty = -1.2 must be"),
        "penalty_inf": ([(PROMPTS[0], SP(repetition_penalty=1e39))], "repetition_penalty = 1e+39 must be"),
        "penalty_nan": ([(PROMPTS[0], SP(repetition_penalty=float("nan")))], "repetition_penalty = nan must be"),
        "penalty_denormal": ([(PROMPTS[0], SP(repetition_penalty=1e-45))], "repetition_penalty = 1e-45 must be"),
    }
    requests = [good] + [(name, "ghost" if name == "unknown_model" else "", rows, False, 0) for name, (rows, _) in bad.items()]
    out = backend.sample(sample_batch(requests))
    for name, (_, message) in bad.items():
        assert isinstance(out[name], types.ErrorResponse) and message in out[name].error, (name, out[name])
    assert len(out["good"].sequences) == 3 and all(len(s.tokens) == 4 for s in out["good"].sequences)
    # 3 rows of one prompt (one prefill), 2 decode slots (max_num_seqs=2): the third row waits for a slot
    assert (backend.metrics.calls["sample_prefill"], backend.metrics.calls["sample_decode"]) == (1, 2)


def test_repetition_penalty_greedy_matches_transformers_generate(tiny_dirs, peft_backend):
    """Per-row penalties in one batch (1.0 = off next to > 1 and < 1) = transformers generate(repetition_penalty)."""
    backend, _ = peft_backend
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["moe"], dtype=torch.float32)
    cases = [(PROMPTS[i % len(PROMPTS)], r) for i, r in enumerate((1.0, 1.3, 0.8, 2.0, 1.15, 1.0, 1.5))]
    requests = [(f"r{i}", "", [(p, SP(max_tokens=14, temperature=0.0, stop=[], repetition_penalty=r))], False, 0)
                for i, (p, r) in enumerate(cases)]
    out = backend.sample(sample_batch(requests))
    plain = {tuple(p): out[f"r{i}"].sequences[0].tokens for i, (p, r) in enumerate(cases) if r == 1.0}
    changed = 0
    for i, (prompt, r) in enumerate(cases):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False, repetition_penalty=r,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        got = out[f"r{i}"].sequences[0].tokens
        assert got == want, (i, r)
        changed += tuple(prompt) in plain and got != plain[tuple(prompt)]
    assert changed >= 1  # the penalty changes some continuation (and 1.0 rows are unaffected by their neighbours)


def _allowed(logits_v, seen, temperature, min_p, penalty):
    """numpy reference: the tokens min-p keeps after the repetition penalty and temperature."""
    x = logits_v.astype(np.float64)
    hit = np.zeros(x.shape, bool)
    hit[list(seen)] = True
    x = np.where(hit, np.where(x > 0, x / penalty, x * penalty), x) / temperature
    probs = np.exp(x - x.max())
    return probs >= min_p * probs.max() * (1 - 1e-4)


def test_min_p_and_penalty_sampling_keep_forward_logprobs_and_programs(peft_backend):
    """Seeded sampling with min-p picks only tokens of the min-p set; log-probs stay those of `forward`; min_p /
    repetition_penalty values reuse the compiled program."""
    backend, _ = peft_backend
    index = backend.models["a"].adapter_index

    def run(settings):  # 8 rows (8 decode slots), 12 new tokens each
        rows = [(PROMPTS[i % 4], SP(max_tokens=12, temperature=t, seed=10 + i, stop=[], min_p=m, repetition_penalty=r))
                for i, (t, m, r) in enumerate(settings)]
        out = backend.sample(sample_batch([(f"m{i}", "a", [row], False, 0) for i, row in enumerate(rows)]))
        return [(row, out[f"m{i}"].sequences[0]) for i, row in enumerate(rows)]

    def programs():
        return {k: v for k, v in backend.metrics.compiles.items() if k.startswith("sample")}

    run([(1.0, 0.1, 1.2)] + [(1.0, 0.0, 1.0)] * 7)  # a penalty and min-p: the programs with their work
    compiles = programs()
    results = run([(1.0, 0.3, 1.0), (1.5, 0.1, 1.0), (0.8, 0.5, 1.3), (1.0, 0.0, 1.0),
                   (1.2, 0.2, 0.9), (1.0, 0.05, 1.0), (1.0, 0.0, 2.0), (2.0, 0.4, 1.1)])
    assert programs() == compiles
    full = [prompt + seq.tokens for (prompt, _), seq in results]
    ids = np.zeros((len(full), max(map(len, full))), np.int64)
    for i, f in enumerate(full):
        ids[i, : len(f)] = f
    adapters = np.full(len(full), index)
    mask = (np.arange(ids.shape[1])[None] < np.array([len(f) for f in full])[:, None]).astype(np.int64)
    all_logits = np.asarray(backend.model.logits(backend.model(ids, mask, adapters), adapters), np.float32)
    kept_sizes = []
    for i, ((prompt, params), seq) in enumerate(results):
        assert len(seq.tokens) == 12
        logits = all_logits[i, len(prompt) - 1 : len(prompt) + 11]
        log_softmax = np.asarray(torch.log_softmax(torch.tensor(logits), -1))
        np.testing.assert_allclose(seq.logprobs, log_softmax[np.arange(12), seq.tokens], atol=1e-4)
        for t, token in enumerate(seq.tokens):
            allowed = _allowed(logits[t], set(prompt) | set(seq.tokens[:t]), params.temperature, params.min_p,
                               params.repetition_penalty)
            assert allowed[token], (params, t)
            if params.min_p >= 0.2:
                kept_sizes.append(allowed.sum())
    assert np.mean(kept_sizes) < all_logits.shape[-1] / 4  # min-p did narrow the choice
