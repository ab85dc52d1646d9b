"""`paged_async_dispatch`: while no request waits to join, the paged engine dispatches the next decode call from
the device's own slot state before reading the current call's results (tx/sampling/continuous.py,
`_chain_steps`). Checked where it is wired, on engines whose calls are short (4-8 steps) so that most calls are
chained: greedy tokens against transformers' `generate` (base and a PEFT LoRA adapter), seeded tokens and their
log-probs against an engine that waits for every call and against `forward`, rows ending on a stop token or
at max_tokens inside a chained call, one program for chained and host-built calls, a mesh of 2 devices, and a
failure while a call is in flight."""

import numpy as np
import pytest
import torch
from peft import LoraConfig as PeftLoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import tx
from tests.helpers import make_batch, peft_weights
from tests.sampling.test_sample import PROMPTS, SP, sample_batch
from tx import types
from tx.models.adapters import get_adapter_weights, set_adapter_weights

BASE = dict(max_lora_adapters=3, max_lora_rank=4, max_seq_len=96, max_num_samples=8)
SHORT_CALLS = dict(kv_page_size=4, kv_block=8, prefill_chunk=8, prefill_rows=4, decode_steps_per_call=4,
                   max_decode_steps_per_call=8, max_num_seqs=8)


def _backend(model_dir: str, **config) -> tx.JaxBackend:
    b = tx.JaxBackend(model_dir, tx.JaxBackendConfig(**(BASE | SHORT_CALLS | config)))
    b.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    return b


@pytest.fixture(scope="module")
def engines(tiny_dirs):
    """(chained, waiting, peft): two engines, async dispatch on and off, whose adapter "a" holds the random
    weights of a PEFT model (B scaled up so the adapter changes greedy outputs)."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs["dense"], dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(base, PeftLoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    for module in peft.modules():
        if hasattr(module, "lora_B") and "default" in module.lora_B:
            with torch.no_grad():
                module.lora_B["default"].weight.mul_(20.0)
    out = []
    for on in (True, False):
        b = _backend(tiny_dirs["dense"], paged_async_dispatch=on)
        set_adapter_weights(b.model, b.models["a"].adapter_index, peft_weights(peft), alpha=8, rank=4)
        out.append(b)
    return out[0], out[1], peft


def _requests(greedy: bool) -> list:
    lengths = (37, 40, 33, 9, 45, 41)
    return [(f"r{i}", ["", "a"][i % 2], [(PROMPTS[i % 4], SP(max_tokens=n, stop=[], seed=i,
                                                           temperature=0.0 if greedy else [1.0, 0.8][i % 2],
                                                           top_p=1.0 if greedy else 0.9))], False, 0)
            for i, n in enumerate(lengths)]


def _chained(b: tx.JaxBackend) -> int:
    return b.metrics.sampling["chained_calls"]


def test_chained_calls_sample_what_transformers_generates(tiny_dirs, engines):
    """Six greedy rows of 9-45 tokens on one engine, calls of 4-8 steps: most calls are dispatched from the
    previous one's device state; the tokens equal transformers' `generate` (base model, and PEFT for the
    adapter's rows), and the engine that waits for every call compiles as many decode programs."""
    chained, waiting, peft = engines
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["dense"], dtype=torch.float32)
    before = _chained(chained)
    out = chained.sample(sample_batch(_requests(greedy=True)))
    assert _chained(chained) - before >= 3, chained.metrics.sampling
    for request_id, model_id, [(prompt, params)], _, _ in _requests(greedy=True):
        ref = peft if model_id else hf
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out[request_id].sequences[0].tokens == want, request_id
    waiting.sample(sample_batch(_requests(greedy=True)))
    assert _chained(waiting) == 0
    assert chained.metrics.compiles["sample_decode"] == waiting.metrics.compiles["sample_decode"]


def test_seeded_rows_and_their_logprobs_do_not_depend_on_async_dispatch(engines):
    """Seeded rows (temperature 1 / 0.8, top-p 0.9): the same tokens with chained calls as on the engine that
    waits for every call, and their log-probs equal a teacher-forced `forward` (1e-4)."""
    chained, waiting, _ = engines
    before = _chained(chained)
    got = chained.sample(sample_batch(_requests(greedy=False)))
    assert _chained(chained) > before
    want = waiting.sample(sample_batch(_requests(greedy=False)))
    fwd = []
    for request_id, model_id, [(prompt, _)], _, _ in _requests(greedy=False):
        x, y = got[request_id].sequences[0], want[request_id].sequences[0]
        assert x.tokens == y.tokens, request_id
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
        full = prompt + x.tokens
        fwd.append((request_id, model_id, [{"input_ids": full[:-1], "targets": full[1:]}], "cross_entropy", None))
    chained.create_model("z", types.LoraConfig(rank=1, seed=0))  # B = 0: the base model, for the base rows
    fwd = [(r, m or "z", d, loss, c) for r, m, d, loss, c in fwd]
    teacher = chained.forward(make_batch(fwd))
    chained.delete_model("z")
    for request_id, _, [(prompt, _)], _, _ in _requests(greedy=False):
        lp = teacher[request_id].loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1:]
        np.testing.assert_allclose(got[request_id].sequences[0].logprobs, lp, atol=1e-4)


def test_rows_ending_inside_a_chained_call_end_exactly(engines):
    """A row that ends on a stop token while the next call is already dispatched runs inactive in it: its answer
    ends at the stop token, with what it samples alone; the rows beside it go on to max_tokens."""
    chained, waiting, _ = engines
    free = waiting.sample(sample_batch([("free", "a", [(PROMPTS[2], SP(max_tokens=40, seed=3, temperature=1.0,
                                                                          stop=[]))], False, 0)]))
    tokens = free["free"].sequences[0].tokens
    # a stop token the row first samples after its second call (4 + 8 steps), not in its prompt's tail
    at = next(i for i in range(13, 40) if tokens[i] not in tokens[:i])
    stop_row = ("stop", "a", [(PROMPTS[2], SP(max_tokens=40, seed=3, temperature=1.0, stop=[tokens[at]]))], False, 0)
    others = [(f"o{i}", "", [(PROMPTS[i], SP(max_tokens=35, seed=10 + i, temperature=1.0, stop=[]))], False, 0)
              for i in range(2)]
    alone = {r[0]: waiting.sample(sample_batch([r]))[r[0]] for r in others}
    before = _chained(chained)
    got = chained.sample(sample_batch([stop_row] + others))
    assert _chained(chained) > before
    seq = got["stop"].sequences[0]
    assert (seq.tokens, seq.stop_reason) == (tokens[: at + 1], "stop")
    for request_id, want in alone.items():
        assert got[request_id].sequences[0].tokens == want.sequences[0].tokens
        assert got[request_id].sequences[0].stop_reason == "length"
    assert chained.sampler.paged.idle and chained.sampler.paged.inflight is None


def test_chained_calls_on_a_two_device_mesh(tiny_dirs, engines):
    """fsdp = 2 (rows split over 2 devices): the carried slot state is laid out as the host's inputs are, so
    chained calls run the same decode program; greedy tokens equal the one-device engine's."""
    chained, _, _ = engines
    two = _backend(tiny_dirs["dense"], fully_sharded_data_parallel_size=2)
    slot = chained.models["a"].adapter_index
    set_adapter_weights(two.model, two.models["a"].adapter_index, get_adapter_weights(chained.model, slot, 4),
                        alpha=8, rank=4)
    want = chained.sample(sample_batch(_requests(greedy=True)))
    got = two.sample(sample_batch(_requests(greedy=True)))
    assert _chained(two) >= 3
    for request_id in want:
        assert got[request_id].sequences[0].tokens == want[request_id].sequences[0].tokens
    two.sample(sample_batch(_requests(greedy=True)))  # again: no program of its own for a chained call
    assert two.metrics.compiles["sample_decode"] == len({k for k in two.runtime.keys() if k[0] == "sample_decode"})


def test_a_failure_while_a_call_is_in_flight_fails_the_requests_and_the_engine_recovers(tiny_dirs, monkeypatch):
    """Reading a call fails while the next one is in flight: `sample_step` raises, every request is dropped, no
    call stays in flight, no page stays held; the next request samples what it samples on a fresh engine."""
    from tx.sampling.paged_calls import PagedDevice

    b = _backend(tiny_dirs["dense"])
    request = _requests(greedy=False)[0]
    read, reads = PagedDevice.read, []

    def failing(self, call):
        reads.append(call)
        if len(reads) == 2:
            raise RuntimeError("device lost")
        return read(self, call)

    monkeypatch.setattr(PagedDevice, "read", failing)
    assert b.sample_submit(sample_batch([request])) == {}
    with pytest.raises(RuntimeError, match="device lost"):
        for _ in range(20):
            b.sample_step()
    paged = b.sampler.paged
    assert paged.inflight is None and paged.idle and paged.kv.pages_in_use == 0 and not b.sampling_active
    assert _chained(b) >= 1  # the failing read had the next call in flight
    monkeypatch.setattr(PagedDevice, "read", read)
    fresh = _backend(tiny_dirs["dense"])
    want = fresh.sample(sample_batch([request]))[request[0]].sequences[0].tokens
    assert b.sample(sample_batch([request]))[request[0]].sequences[0].tokens == want


def test_penalty_and_min_p_rows_through_chained_calls_equal_the_oracle(engines):
    """The repetition penalty's token sets and the stop window are carried from call to call on the device:
    penalized greedy and min-p rows over 30-40 tokens give the tests' oracle's tokens and log-probs."""
    from tests.sampling import oracle

    chained, _, _ = engines
    requests = [("rp", "", [(PROMPTS[2], SP(max_tokens=40, temperature=0.0, repetition_penalty=1.5, stop=[]))],
                 False, 0),
                ("both", "", [(PROMPTS[1], SP(max_tokens=30, temperature=0.9, min_p=0.05, repetition_penalty=0.8,
                                               seed=2, stop=[]))] * 2, False, 0),
                ("plain", "", [(PROMPTS[3], SP(max_tokens=36, temperature=0.0, stop=[]))], False, 0)]
    before = _chained(chained)
    got = chained.sample(sample_batch(requests))
    assert _chained(chained) - before >= 2
    want = oracle.sample(chained, sample_batch(requests))
    for request_id, *_ in requests:
        assert [s.tokens for s in want[request_id].sequences] == [s.tokens for s in got[request_id].sequences]
        for x, y in zip(want[request_id].sequences, got[request_id].sequences):
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)


def test_calls_go_ahead_while_requests_wait_for_full_slots(tiny_dirs, engines):
    """4 slots, 7 rows of three requests: while every slot holds a row that runs on past the current call and a
    prefilled request waits, the next (short) call is dispatched from the device's state; the waiting rows
    still take the slots as rows end, and every row samples what it samples alone."""
    _, waiting, _ = engines
    b = _backend(tiny_dirs["dense"], max_num_seqs=4)
    requests = [(f"q{i}", "", [(PROMPTS[i], SP(max_tokens=n, temperature=1.0, seed=i, stop=[]))] * k, False, 0)
                for i, (n, k) in enumerate([(30, 3), (24, 2), (20, 2)])]
    alone = {r[0]: waiting.sample(sample_batch([r]))[r[0]] for r in requests}
    paged, decode, queued = b.sampler.paged, b.sampler.paged.device.decode, []

    def spy(live, bound, after=None):
        if after is not None:
            queued.append(bool(paged.ready))
        return decode(live, bound, after)

    b.sampler.paged.device.decode = spy
    got = b.sample(sample_batch(requests))
    assert any(queued) and not all(queued), queued  # ahead while rows queued, and after they all had slots
    for request_id, want in alone.items():
        assert [s.tokens for s in got[request_id].sequences] == [s.tokens for s in want.sequences]
        for x, y in zip(got[request_id].sequences, want.sequences):
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
