"""Continuous batching through the service (the paged engine), driven by the tinker SDK: a short
request joins a long running batch and returns long before it; a resent conversation reads its first turn
from the prefix cache (per tenant); training requests run while a long sampling job is in flight."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import tinker
from tinker import types as T

from tests.api import sdk_flows
from tests.api.server_proc import ADMIN_KEY, Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("continuous"), "--max-seq-len", "640",
                 "--max-num-seqs", "16", "--decode-steps-per-call", "2", "--kv-page-size", "16",
                 "--kv-block", "64", "--prefill-chunk", "64", "--kv-cache-pages", "400")
    yield srv
    srv.stop()


def timed(future) -> tuple[T.SampleResponse, float]:
    response = future.result()
    return response, time.perf_counter()


def long_and_short(server, sampler, prompt: T.ModelInput) -> tuple[float, float]:
    """A 512-token batch of 8, and once it decodes a request for 8 tokens: (short's seconds, long's seconds)."""
    steps = server.get("/api/v1/metrics", key=ADMIN_KEY).json()["engine"].get("sample_steps", 0)
    with ThreadPoolExecutor(2) as pool:
        t0 = time.perf_counter()
        long = pool.submit(timed, sampler.sample(prompt, 8, T.SamplingParams(max_tokens=512, seed=1, stop=[])))
        while server.get("/api/v1/metrics", key=ADMIN_KEY).json()["engine"].get("sample_steps", 0) < steps + 8:
            time.sleep(0.01)  # wait until the long batch is decoding
        t1 = time.perf_counter()
        short = pool.submit(timed, sampler.sample(prompt, 1, T.SamplingParams(max_tokens=8, seed=2, stop=[])))
        (long_out, long_end), (short_out, short_end) = long.result(), short.result()
    assert [len(s.tokens) for s in long_out.sequences] == [512] * 8
    assert len(short_out.sequences[0].tokens) == 8
    return short_end - t1, long_end - t0


def test_a_short_request_joins_a_long_batch_and_returns_first(server):
    sampler = sdk_flows.service(server.url).create_sampling_client(base_model="tiny").result()
    prompt = T.ModelInput.from_ints(list(range(10, 30)))
    # compile the decode programs the measured run can use: 8 rows (the long batch), 9 (the short one
    # joined: slot bucket 16) and 1 (the short one alone), so the measurement times no compile
    for rows in (9, 8, 1):
        sampler.sample(prompt, rows, T.SamplingParams(max_tokens=16, stop=[])).result()
    compiles = server.get("/api/v1/metrics", key=ADMIN_KEY).json()["backend_compiles"]
    short_s, long_s = long_and_short(server, sampler, prompt)
    assert server.get("/api/v1/metrics", key=ADMIN_KEY).json()["backend_compiles"] == compiles
    # a short request that waited for the long batch would take ~long_s; alone on this CPU it takes ~0.14 x,
    # in CI beside another test worker up to 0.22 x (one run of three): the bound leaves room for that load
    assert short_s <= 0.35 * long_s, (short_s, long_s)


def test_a_resent_conversation_reads_its_first_turn_from_the_cache(server):
    service = sdk_flows.service(server.url)
    tc = service.create_lora_training_client(base_model="tiny", rank=8, seed=3).result()
    sampler = tc.save_weights_and_get_sampling_client(name="turns")
    sampler = sampler.result() if hasattr(sampler, "result") else sampler
    turn1 = list(range(100, 180))  # 80 tokens = 5 pages of 16
    params = T.SamplingParams(max_tokens=24, seed=5, stop=[])
    first = sampler.sample(T.ModelInput.from_ints(turn1), 1, params).result()
    turn2 = turn1 + list(first.sequences[0].tokens) + [7, 8, 9]
    second = sampler.sample(T.ModelInput.from_ints(turn2), 1, params).result()
    # the first turn wrote prompt + 23 tokens (the last sampled token's K/V is never computed): 103 -> 6 pages
    assert first.prompt_cache_hit_tokens == 0
    assert second.prompt_cache_hit_tokens == (len(turn1) + 24 - 1) // 16 * 16
    metrics = server.get("/api/v1/metrics", key=ADMIN_KEY).json()
    assert metrics["backend_sampling"]["prefill_tokens_cached"] >= second.prompt_cache_hit_tokens


def test_training_runs_while_a_long_sampling_job_is_in_flight(server):
    """forward_backward and optim_step sent while 16 rows sample 600 tokens each complete before the rows
    have sampled everything (told by the engine's decode-token count, not by the clock)."""
    service = sdk_flows.service(server.url)
    sampler = service.create_sampling_client(base_model="tiny").result()
    tc = service.create_lora_training_client(base_model="tiny", rank=8, seed=4).result()
    data = sdk_flows.datums(4)
    tc.forward_backward(data, "cross_entropy").result()  # compiled before the sampling job starts

    def metrics():
        return server.get("/api/v1/metrics", key=ADMIN_KEY).json()

    steps, before = metrics()["engine"].get("sample_steps", 0), metrics()["backend_sampling"]["decode_tokens"]
    rows, length = 16, 600
    long = sampler.sample(T.ModelInput.from_ints(list(range(5, 25))), rows,
                          T.SamplingParams(max_tokens=length, seed=3, stop=[]))
    while metrics()["engine"].get("sample_steps", 0) < steps + 2:  # the job is decoding
        time.sleep(0.01)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(T.AdamParams(learning_rate=1e-3)).result()
    sampled = metrics()["backend_sampling"]["decode_tokens"] - before
    out = long.result()
    assert [len(s.tokens) for s in out.sequences] == [length] * rows
    assert sampled < rows * length, "training waited for the whole sampling job"
    assert isinstance(out, tinker.SampleResponse)
