"""Requests in flight on the paged engine (`sample_submit` / `sample_step`): joining a running batch,
preemption when pages run out, weights that change under running requests, and the number of programs
over many random requests. Each result is compared with the same request sampled alone."""

import numpy as np
import pytest

import tx
from tests.helpers import make_batch
from tests.sampling.test_sample import PROMPTS, SP, sample_batch
from tx import types

BASE = dict(max_lora_adapters=3, max_lora_rank=4, max_seq_len=96, max_num_samples=8)
# 4 decode steps per call whether or not requests wait: rows join and leave between calls often
PAGED = dict(kv_page_size=4, kv_block=8, prefill_chunk=8, prefill_rows=2,
             decode_steps_per_call=4, max_decode_steps_per_call=4, max_num_seqs=16)


@pytest.fixture(scope="module")
def backend(tiny_dirs):
    b = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **PAGED))
    b.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    return b


def drive_steps(backend, batches):
    """Submit `batches[k]` (a batch, a list of batches or None) before the k-th step; step until idle.
    Results by id, and the step each request finished in."""
    out, step_of, k = {}, {}, 0
    while k < len(batches) or backend.sampling_active:
        submit = batches[k] if k < len(batches) else None
        for batch in submit if isinstance(submit, list) else [] if submit is None else [submit]:
            assert backend.sample_submit(batch) == {}
        for request_id, result in backend.sample_step().items():
            out[request_id], step_of[request_id] = result, k
        k += 1
    return out, step_of


def drive(backend, batches):
    return drive_steps(backend, batches)[0]


def alone(backend, requests):
    return {r[0]: backend.sample(sample_batch([r]))[r[0]] for r in requests}


def same(a: types.SampleOutput, b: types.SampleOutput):
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert [s.stop_reason for s in a.sequences] == [s.stop_reason for s in b.sequences]
    for x, y in zip(a.sequences, b.sequences):
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)


def test_requests_joining_a_running_batch_sample_what_they_sample_alone(backend):
    long = ("long", "a", [(PROMPTS[2], SP(max_tokens=60, temperature=1.0, seed=9, stop=[]))] * 3, False, 0)
    short = ("short", "", [(PROMPTS[0], SP(max_tokens=8, temperature=1.0, seed=4, stop=[]))] * 2, False, 0)
    later = ("later", "a", [(PROMPTS[1], SP(max_tokens=20, temperature=0.7, top_p=0.9, seed=1))], False, 0)
    want = alone(backend, [long, short, later])
    out, steps_of = drive_steps(backend, [sample_batch([long]), None, None, sample_batch([short]), None,
                                          sample_batch([later])])
    for request_id in want:
        same(want[request_id], out[request_id])
    # the short request joined at step 3 and left long before the long one ended: 8 tokens = 2 calls of 4
    assert steps_of["short"] - 3 <= 3 < steps_of["long"] - steps_of["short"]


def _free_sample(backend) -> list[int]:
    free = ("free", "a", [(PROMPTS[2], SP(max_tokens=60, temperature=1.0, seed=9, stop=[]))], False, 0)
    return alone(backend, [free])["free"].sequences[0].tokens


def _with_stop(backend, stop: str, beside: tuple | None = None) -> tuple[dict, int, int]:
    """The free sample's request ("stop") with `stop` (and request `beside` in the same batch): the outputs, the tokens
    the engine decoded and those it dropped (sampled for a row already ended, in a call dispatched before the
    host saw the stop: `paged_async_dispatch`)."""
    stats = backend.sampler.paged.stats
    before, dropped = stats["decode_tokens"], stats["decode_tokens_dropped"]
    request = ("stop", "a", [(PROMPTS[2], SP(max_tokens=60, temperature=1.0, seed=9, stop=[stop]))], False, 0)
    out = backend.sample(sample_batch([request] + ([beside] if beside else [])))
    decoded = stats["decode_tokens"] - before
    # a call dispatched before the host saw the last row end is read (and dropped) by the engine's next iteration
    flush = ("flush", "", [(PROMPTS[0], SP(max_tokens=1, stop=[]))], False, 0)
    backend.sample(sample_batch([flush]))
    return out, decoded, stats["decode_tokens_dropped"] - dropped


def _contains(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i:i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


def _host_only_stop(backend) -> tuple[str, list[int], int]:
    """A stop string the free sample writes with other tokens than the tokenizer's own (so the device cannot
    see it), whose last character comes with the first token of a call of 4 steps and the others with the
    call before; the sample, and the length of its answer cut after the stop."""
    tokens, sampler = _free_sample(backend), backend.sampler
    for end in range(9, 57, 4):  # calls of 4 steps: token end - 1 opens a call
        stop = sampler.decode_text(tokens[:end])[-3:]  # three characters the sample writes by its end-th token
        if (len(stop.strip()) == 3 and stop not in sampler.decode_text(tokens[end - 1:end])
                and not _contains(tokens, sampler.encode_text(stop))):
            break
    else:
        pytest.fail("no stop string the device cannot see in the sample")
    return stop, tokens, next(n for n in range(1, len(tokens) + 1) if stop in sampler.decode_text(tokens[:n]))


def test_a_row_ends_at_the_call_that_completes_a_stop_string(backend):
    """A stop string the device cannot see ends its row after the decode call that completes it, not at
    max_tokens: the answer is the free sample cut after the first prefix whose text contains the stop (found
    here by decoding every prefix), and the engine decoded at most one call (4 steps) past it. The stop
    straddles a call boundary. The next call was already dispatched when the host found the stop: it ran on
    in it, one call (4 tokens, dropped), and no further."""
    stop, tokens, cut = _host_only_stop(backend)
    out, decoded, dropped = _with_stop(backend, stop)
    got = out["stop"].sequences[0]
    assert (got.tokens, got.stop_reason) == (tokens[:cut], "stop")
    assert cut <= decoded < cut + 4, (decoded, cut)
    assert dropped == 4


def test_a_row_ended_on_the_host_runs_on_for_one_call_beside_rows_that_go_on(backend):
    """As above, beside rows that go on decoding in calls dispatched from the device's state: the ended
    row's slot is turned off in the first call dispatched after the host saw its stop, so it costs one call
    (4 dropped tokens), not the rest of its companion's run; both answers are what they are alone."""
    stop, tokens, cut = _host_only_stop(backend)
    # 3 rows beside it: 4 slots before it ends and after, so the calls go on being dispatched from the device
    companion = ("beside", "", [(PROMPTS[0], SP(max_tokens=60, temperature=1.0, seed=4, stop=[]))] * 3, False, 0)
    want = alone(backend, [companion])["beside"]
    out, _, dropped = _with_stop(backend, stop, companion)
    got = out["stop"].sequences[0]
    assert (got.tokens, got.stop_reason) == (tokens[:cut], "stop")
    same(out["beside"], want)
    assert dropped == 4
    assert backend.sampler.paged.stats["chained_calls"] > 0


def test_a_stop_string_in_the_tokenizers_own_tokens_ends_its_row_on_the_device(backend):
    """A stop string written as the tokenizer writes it (2-3 tokens) is matched on the device, over the
    row's last generated tokens carried through the decode loop and over call boundaries (the first token
    ends a call of 4 steps): the row ends at the token that completes it, and the answer equals the host's
    cut."""
    tokens, sampler = _free_sample(backend), backend.sampler
    for start in range(7, 55, 4):
        seq = tokens[start:start + 3]
        stop = sampler.decode_text(seq)
        if sampler.encode_text(stop) == seq and stop not in sampler.decode_text(tokens[:start + 2]):
            break
    else:
        pytest.fail("no 3 tokens of the sample that the tokenizer writes the same way")
    cut = next(n for n in range(1, len(tokens) + 1) if stop in sampler.decode_text(tokens[:n]))
    assert cut == start + 3
    out, decoded, dropped = _with_stop(backend, stop)
    got = out["stop"].sequences[0]
    assert (got.tokens, got.stop_reason) == (tokens[:cut], "stop")
    assert (decoded, dropped) == (cut, 0)  # the device ended the row: the call after it ran no step for it


@pytest.mark.parametrize("async_dispatch", [False, True])
def test_calls_run_long_unless_a_request_waits_and_share_one_program(tiny_dirs, backend, async_dispatch):
    """With nothing waiting a call runs up to max_decode_steps_per_call (32) steps, half of it with async
    dispatch (a request that arrives waits for the call in flight and the one behind it); while a request
    waits for the one slot, decode_steps_per_call (4). The bound is traced: one decode program for all, and
    the tokens are those of the fixed-4-step engine."""
    one = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **(PAGED | dict(
        max_num_seqs=1, max_decode_steps_per_call=32, paged_async_dispatch=async_dispatch))))
    one.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    first = ("first", "a", [(PROMPTS[2], SP(max_tokens=60, temperature=1.0, seed=9, stop=[]))], False, 0)
    second = ("second", "a", [(PROMPTS[1], SP(max_tokens=40, temperature=0.7, seed=2, stop=[]))], False, 0)
    want = alone(backend, [first, second])  # 4 steps per call
    calls = lambda: one.metrics.sampling["calls"]  # noqa: E731
    same(one.sample(sample_batch([first]))["first"], want["first"])
    # 60 tokens: 32 + 28, or 16 + 16 + 16 + 12 (each dispatched before the host read the one before)
    assert (calls(), one.metrics.sampling["chained_calls"]) == ((4, 3) if async_dispatch else (2, 0))
    assert one.metrics.compiles["sample_decode"] == 1
    before = calls()
    out = drive(one, [sample_batch([first, second])])  # second waits for the slot while first decodes
    same(out["first"], want["first"])
    same(out["second"], want["second"])
    # first in 4-step calls, then second alone: 32 + 8, or 16 + 16 + 8
    assert calls() - before == 60 // 4 + (3 if async_dispatch else 2)
    assert one.metrics.compiles["sample_decode"] == 1


def test_a_request_prefilled_in_an_iteration_decodes_in_it(backend):
    """Prefill and the first decode call in one iteration: a short request on an idle engine is done after one
    `sample_step` (prefill, then 3 tokens in one 4-step call), with the tokens it samples alone."""
    fresh = [11, 12, 13, 14, 15, 16, 17]  # a prompt no other test sends: not in the prefix cache
    short = ("short", "a", [(fresh, SP(max_tokens=3, temperature=1.0, seed=5, stop=[]))] * 2, False, 0)
    before = backend.metrics.sampling["prefill_tokens"]
    out, steps_of = drive_steps(backend, [sample_batch([short])])
    assert backend.metrics.sampling["prefill_tokens"] - before == len(fresh)  # it was prefilled, not cached
    assert steps_of["short"] == 0
    same(out["short"], alone(backend, [short])["short"])


def test_a_tiny_pool_preempts_and_every_request_finishes_correctly(tiny_dirs, backend):
    """The minimum pool (one longest prompt + one longest row) with 16 slots: rows grow until pages run out,
    the youngest are preempted, resumed later from their tokens so far, and sample exactly the same tokens."""
    tight = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **(PAGED | dict(kv_cache_pages=51))))
    tight.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    requests = [(f"r{i}", "" if i % 2 else "a",
                 [(list(range(3 + i, 30 + 2 * i)), SP(max_tokens=40 + i, temperature=1.0, seed=i, stop=[]))] * 3,
                 False, 0) for i in range(4)]
    want = alone(backend, requests)
    got = drive(tight, [sample_batch(requests)])
    for request_id in want:
        same(want[request_id], got[request_id])
    stats = tight.metrics.sampling
    assert stats["preempted"] > 0 and stats["peak_pages"] <= 50


def test_prefilled_prompts_holding_every_page_make_room_for_the_first(tiny_dirs, backend):
    """No row decodes and the prefilled prompts hold every page but one: each request passed admission with
    room for its own first call (the last one's 1 page), not for the first's (2 pages: its prompt ends
    mid-page), and only decoding rows used to free pages. The youngest admitted requests are released instead
    (prefilled again later), so the engine always progresses; every request samples what it samples alone."""
    tight = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **(PAGED | {"kv_cache_pages": 51})))
    greedy = SP(max_tokens=10, temperature=0.0, stop=[])
    # prompt positions (all but the last token) 30, 80 and 84: 8 + 20 + 21 = 49 of the 50 pages; the first
    # row's call writes positions 30..33 (its copy of page 7, and page 8), the last's 84..87 (one page)
    requests = [(f"p{n}", "", [(list(range(3 + i, 4 + i + n)), greedy)], False, 0)
                for i, n in enumerate((30, 80, 84))]
    want = alone(backend, requests)
    assert tight.sample_submit(sample_batch(requests)) == {}
    got = {}
    for _ in range(40):  # 15 suffice: 13 prefill calls of 16 positions, 3 decode calls per request
        got.update(tight.sample_step())
        if not tight.sampling_active:
            break
    assert not tight.sampling_active, f"no progress: {sorted(got)} finished of {[r[0] for r in requests]}"
    for request_id in want:
        same(want[request_id], got[request_id])
    assert tight.sampler.paged.idle and tight.metrics.sampling["peak_pages"] <= 50


def test_weights_changing_under_a_running_request_finish_it_first(backend):
    """An optim_step of an adapter that running rows sample from lets them finish on the old weights first
    (their results come with the next step); requests on other weights keep running."""
    prompt = PROMPTS[2]
    on_a = ("on_a", "a", [(prompt, SP(max_tokens=30, temperature=1.0, seed=3, stop=[]))] * 2, False, 0)
    on_base = ("on_base", "", [(prompt, SP(max_tokens=50, temperature=1.0, seed=3, stop=[]))], False, 0)
    want = alone(backend, [on_a, on_base])
    assert backend.sample_submit(sample_batch([on_a, on_base])) == {}
    first = backend.sample_step()
    assert first == {}
    backend.forward_backward(make_batch([("fb", "a", [{"input_ids": prompt, "targets": prompt[1:] + [1]}],
                                          "cross_entropy", None)]))
    backend.optim_step("a", types.OptimStepInput(adam_params=types.AdamParams(learning_rate=0.5)))
    assert backend.sampler.paged.reads(backend.models["a"].adapter_index) is False
    rest = drive(backend, [])
    same(want["on_a"], rest["on_a"])
    same(want["on_base"], rest["on_base"])
    changed = alone(backend, [on_a])["on_a"]
    assert [s.tokens for s in changed.sequences] != [s.tokens for s in want["on_a"].sequences]


def test_a_tenant_with_many_queued_requests_shares_the_slots(backend):
    """Tenant A queues 6 requests of 4 rows, then tenant B one (16 slots): B is admitted next to A's first
    requests instead of behind all of A's, and every request samples what it samples alone."""
    params = SP(max_tokens=12, temperature=1.0, seed=5, stop=[])
    flood = [(f"a{i}", "", [(PROMPTS[i % 3], params)] * 4, False, 0) for i in range(6)]
    small = ("b", "", [(PROMPTS[1], params)] * 4, False, 0)
    want = alone(backend, flood + [small])
    batch_a, batch_b = sample_batch(flood), sample_batch([small])
    batch_a.request_tenants, batch_b.request_tenants = ["A"] * len(flood), ["B"]
    out, step_of = drive_steps(backend, [[batch_a, batch_b]])
    for request_id in want:
        same(want[request_id], out[request_id])
    # 16 slots: a0..a2 and b decode together; a3 (before b in arrival order) waits for a slot
    assert step_of["b"] < step_of["a3"], step_of
    assert step_of["b"] <= min(step_of[f"a{i}"] for i in range(3)) + 1, step_of


@pytest.mark.parametrize("paged", [PAGED, {}], ids=["small_pages", "defaults"])
def test_programs_stay_bounded_over_200_random_requests(tiny_dirs, paged):
    """200 requests with random prompt lengths, max_tokens, num_samples, stop lists and sampling parameters,
    submitted in random groups between steps (the service's way): at most 12 compiled programs, with this
    file's small pages and 16 slots, and with the engine's defaults (64 slots, every count a power of 2)."""
    b = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **paged))
    b.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    rng = np.random.default_rng(0)
    requests = []
    for i in range(200):
        n = int(rng.integers(1, 40))
        stop = [int(t) for t in rng.integers(0, 500, int(rng.integers(0, 5)))] if rng.random() < 0.7 else None
        params = SP(max_tokens=int(rng.integers(0, 24)), temperature=float(rng.choice([0.0, 0.7, 1.0])),
                    top_k=int(rng.choice([-1, 5, 50])), top_p=float(rng.choice([1.0, 0.9])), seed=i, stop=stop)
        requests.append((f"q{i}", str(rng.choice(["", "a"])), [(rng.integers(1, 500, n).tolist(), params)]
                         * int(rng.integers(1, 5)), False, 0))
    batches, at = [], 0
    while at < len(requests):
        k = int(rng.integers(0, 12))
        batches.append(sample_batch(requests[at:at + k]) if k else None)
        at += k
    got = drive(b, batches)
    assert set(got) == {r[0] for r in requests}
    assert all(len(s.tokens) <= r[2][0][1].max_tokens for r in requests for s in got[r[0]].sequences)
    programs = sum(v for k, v in b.metrics.compiles.items() if k.startswith("sample"))
    assert programs <= 12, b.metrics.compiles


def test_a_long_call_ends_when_half_the_slots_could_go(tiny_dirs):
    """With no request waiting a decode call may run `max_decode_steps_per_call` steps, but every slot of the
    call costs its compute until it returns: once enough rows will have written their max_tokens that the
    rest fit half the slots, the call ends there. Tokens are those of each request alone."""
    b = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **(PAGED | {"max_decode_steps_per_call": 64})))
    short = ("short", "", [(PROMPTS[0], SP(max_tokens=10, temperature=1.0, seed=4, stop=[]))] * 4, False, 0)
    long = ("long", "", [(PROMPTS[1], SP(max_tokens=40, temperature=1.0, seed=5, stop=[]))] * 4, False, 0)
    want = alone(b, [short, long])
    calls, decode = [], b.sampler.paged.device.decode

    def spy(live, bound, after=None):
        calls.append((len(live), bound))
        return decode(live, bound, after)

    b.sampler.paged.device.decode = spy
    out = drive(b, [[sample_batch([short]), sample_batch([long])]])
    for request_id in want:
        same(want[request_id], out[request_id])
    all_eight = [bound for n, bound in calls if n == 8]
    assert all_eight and sum(all_eight) <= 10, calls  # 8 slots only until the short rows are done
    assert max(bound for _, bound in calls) > 4, calls  # the rest still ran in long calls


def test_a_shrinking_batch_steps_down_through_eighths_slot_counts(tiny_dirs, monkeypatch):
    """Above 64 rows the decode slot counts on CPU split each octave in eighths: 120 live rows run on 128 slots
    only until the 40 short rows are done, then the 80 left run on 80 slots, not on 128 (or 96) to the end.
    Tokens are those of each request alone."""
    import tx.sampling.paged_calls as paged_calls

    cfg = BASE | PAGED | {"max_num_seqs": 128, "prefill_rows": 64, "max_decode_steps_per_call": 64}  # one prefill
    b = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**cfg))
    requests = [(f"r{i}", "", [(PROMPTS[i % 4], SP(max_tokens=6 if i < 10 else 20, temperature=1.0, seed=i,
                                                   stop=[]))] * 4, False, 0) for i in range(30)]
    want = alone(b, [requests[0], requests[29]])
    seen, count = [], paged_calls.slot_count

    def spy(live, *args):
        seen.append((live, count(live, *args)))
        return seen[-1][1]

    monkeypatch.setattr(paged_calls, "slot_count", spy)
    out = drive(b, [sample_batch(requests)])
    for request_id in want:
        same(want[request_id], out[request_id])
    assert (120, 128) in seen and (80, 80) in seen, seen
    assert all(slots <= 80 for live, slots in seen if live <= 80), seen
