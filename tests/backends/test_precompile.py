"""`--precompile` (tx/backends/precompile.py): the shape grid is every shape the planner can produce, and after
precompiling, random training rounds and sampling batches compile nothing more."""

from __future__ import annotations

import numpy as np
import pytest

import tx
from tx import types
from tx.backends.batching import micro_batch_shape, model_pass_shapes, plan_micro_batches
from tx.backends.precompile import (SCRATCH, decode_block_prompts, one_row_prefill_prompts, precompile,
                                   prefill_prompt_lengths)
from tx.sampling.call_shapes import prefill_row_count

MAX_SEQ, BUDGET = 24, 32  # 3 shapes: 2 x 16 and 1 x 16, 1 x 24


@pytest.mark.parametrize("max_seq,budget,cap,fsdp",
                         [(48, 128, 0, 1), (100, 0, 6, 2), (300, 1024, 8, 2), (64, 256, 0, 4)])
def test_shapes_are_what_the_planner_makes(max_seq, budget, cap, fsdp):
    """Derived independently: every (rows, length) shape a micro-batch of equal-length rows can take within
    the budget (or one row alone), and every group the planner cuts from random rounds, is in the grid,
    and every grid shape is one of the former."""
    grid = {(r, s) for r, s, _ in model_pass_shapes(max_seq, budget, cap, fsdp)}
    possible = set()
    for length in range(1, max_seq + 1):
        for n in range(1, (budget // 16 if budget else cap) + 2):
            rows, seq = micro_batch_shape([length] * n, fsdp, cap)
            if n == 1 or not budget or rows * seq <= budget:
                possible.add((rows, seq))
    assert grid == possible
    rng = np.random.default_rng(0)
    for _ in range(40):
        lengths = rng.integers(1, max_seq + 1, rng.integers(1, 40)).tolist()
        for group in plan_micro_batches(lengths, budget, cap, fsdp):
            assert micro_batch_shape([lengths[i] for i in group], fsdp, cap) in grid
    assert all(n <= max_seq for _, _, n in model_pass_shapes(max_seq, budget, cap, fsdp))


def test_unbounded_grid_refused():
    with pytest.raises(ValueError, match="train_micro_batch_tokens or train_micro_batch_size"):
        model_pass_shapes(64, 0, 0, 1)


@pytest.mark.parametrize("max_seq,page,kv_block", [(24, 4, 8), (96, 4, 8), (4096, 16, 64), (100, 16, 16)])
def test_decode_block_prompts_reach_every_bucket_first(max_seq, page, kv_block):
    """Derived by brute force: the block count of a decode call whose furthest input is at each position an
    input can take (0 .. max_seq - 2), a power of two at most what the table spans; the prompts are the
    first length (>= 2) reaching each count, with 2 new tokens (the furthest input sits at the length)."""
    span = (-(-max_seq // page) + 1) * page  # table pages, one spare, in tokens
    count = {pos: min(1 << (pos // kv_block).bit_length(), -(-span // kv_block)) for pos in range(max_seq - 1)}
    first = {}
    for pos in range(2, max_seq - 1):
        first.setdefault(count[pos], pos)
    assert decode_block_prompts(max_seq, page, kv_block) == sorted(first.values())
    assert {count[p] for p in range(max_seq - 1)} <= {count[p] for p in first.values()} | {1}


@pytest.mark.parametrize("max_seq,chunk,rows,slots,fsdp", [(24, 8, 4, 2, 1), (256, 64, 64, 2, 1), (96, 8, 2, 8, 1),
                                                          (512, 16, 64, 4, 2), (2048, 64, 64, 64, 1)])
def test_prefill_prompt_lengths_reach_every_row_count(max_seq, chunk, rows, slots, fsdp):
    """Brute force: the row counts a first prefill call can take (up to `slots` prompts of 1 .. max_seq - 2
    tokens admitted at once, each prefilled whole) are each reached by the slot-count runs (one one-chunk
    prompt) or by one of the prompt sets, which stay within those limits."""
    def chunks(n):
        return -(-n // chunk)

    per_prompt = max(chunks(n) for n in range(1, max_seq - 1))
    reachable = {prefill_row_count(w, rows, fsdp) for w in range(1, slots * per_prompt + 1)}
    sets = prefill_prompt_lengths(max_seq, chunk, rows, slots, fsdp)
    assert all(len(lengths) <= slots and all(1 <= n <= max_seq - 2 for n in lengths) for lengths in sets)
    covered = {prefill_row_count(1, rows, fsdp)}
    covered |= {prefill_row_count(sum(chunks(n) for n in lengths), rows, fsdp) for lengths in sets}
    assert covered == reachable


def test_one_row_prefill_prompts():
    """Every width a one-row prefill call takes for prompts of 1 .. max_seq - 2 tokens (brute force), each with a
    prompt in those limits whose one-row prefill takes it."""
    from tx.sampling.call_shapes import prefill_width

    def width(n):  # a prompt of n tokens alone: its first call writes min(n, chunk) tokens
        return prefill_width(min(n, chunk), 1, chunk)

    for max_seq, chunk in [(24, 8), (24, 16), (100, 64), (32, 64), (6, 8), (40, 1), (40, 2)]:
        prompts = one_row_prefill_prompts(max_seq, chunk)
        assert set(prompts) == {width(n) for n in range(1, max_seq - 1)}, (max_seq, chunk)
        assert all(1 <= n <= max_seq - 2 and width(n) == w for w, n in prompts.items()), (max_seq, chunk, prompts)


def test_precompile_covers_the_decode_block_buckets(tiny_dirs):
    """`paged_kv_blocks="bucketed"` (GPUs'): every slot count at every block bucket is compiled ahead, so
    random sampling after it compiles nothing."""
    backend = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(
        max_lora_adapters=3, max_lora_rank=4, max_seq_len=MAX_SEQ, train_micro_batch_tokens=BUDGET,
        max_num_seqs=2, prefill_rows=4, prefill_chunk=8, kv_page_size=4, kv_block=8, paged_kv_blocks="bucketed",
        max_num_samples=1))
    backend.create_model("tenant", types.LoraConfig(rank=4, seed=1))
    summary = precompile(backend, backend, loss_fns=())  # sampling only: the training grid is the next test's
    assert summary["decode_block_prompts"] == [2, 8, 16]  # blocks 1, 2, 4 (a 28-token table spans 4)
    compiled = dict(backend.metrics.compiles)
    assert compiled["sample_decode"] == 2 * 3  # 2 slot counts x 3 buckets
    rng = np.random.default_rng(2)
    for _ in range(6):
        n = int(rng.integers(1, 3))
        prompts = [rng.integers(3, 64, int(rng.integers(2, 20))).tolist() for _ in range(n)]
        batch = types.PreparedSampleBatch(
            all_prompts=prompts, all_sampling_params=[types.SamplingParams(max_tokens=MAX_SEQ - len(p), seed=i)
                                                      for i, p in enumerate(prompts)],
            all_model_ids=["tenant"] * n, all_checkpoint_ids=[""] * n, all_checkpoint_paths=[""] * n,
            request_batch_slices=[(f"s{i}", "tenant", i, i + 1, False, 0) for i in range(n)])
        res = backend.sample(batch)
        assert all(isinstance(r, types.SampleOutput) for r in res.values()), res
    assert backend.metrics.compiles == compiled, "a program compiled after --precompile"


@pytest.mark.parametrize("prefill_rows", [64, 4])
def test_precompile_covers_the_eighths_slot_counts(tiny_dirs, prefill_rows):
    """On CPU (`decode_slot_counts` "auto") 81-96 live rows decode on 96 slots: --precompile compiles that count
    too (and 80, 112), so an 88-row call after it compiles nothing. Also where one prefill call takes fewer
    prompts than there are slots (prefill_rows 4): precompile's n rows still all decode together."""
    backend = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(
        max_lora_adapters=3, max_lora_rank=4, max_seq_len=MAX_SEQ, max_num_seqs=128, prefill_rows=prefill_rows,
        prefill_chunk=8, kv_page_size=4, kv_block=8, max_num_samples=1))
    backend.create_model("tenant", types.LoraConfig(rank=4, seed=1))
    summary = precompile(backend, backend, loss_fns=())
    assert summary["sample_slot_counts"] == [1, 2, 4, 8, 16, 32, 64, 80, 96, 112, 128]
    compiled = dict(backend.metrics.compiles)
    res = backend.sample(_sample(88, "tenant", np.random.default_rng(3)))
    assert all(isinstance(r, types.SampleOutput) for r in res.values()), res
    assert backend.metrics.compiles == compiled, "a program compiled after --precompile"


def _train(rows_lengths: list[int], model_id: str, rng) -> types.PreparedModelPassBatch:
    ids = [rng.integers(0, 64, n).tolist() for n in rows_lengths]
    k = len(ids)
    return types.PreparedModelPassBatch(
        all_input_ids=ids, all_targets=ids, all_token_weights=[[1.0] * len(s) for s in ids],
        all_sampling_logprobs=[[]] * k, all_advantages=[[]] * k, all_model_ids=[model_id] * k,
        all_loss_fns=["cross_entropy"] * k, all_loss_fn_configs=[None] * k,
        request_batch_slices=[("fb", model_id, 0, k)])


def _sample(n: int, model_id: str, rng) -> types.PreparedSampleBatch:
    prompts = [rng.integers(3, 64, int(rng.integers(2, 12))).tolist() for _ in range(n)]
    return types.PreparedSampleBatch(
        all_prompts=prompts, all_sampling_params=[types.SamplingParams(max_tokens=int(rng.integers(1, 12)), seed=i)
                                                  for i in range(n)],
        all_model_ids=[model_id] * n, all_checkpoint_ids=[""] * n, all_checkpoint_paths=[""] * n,
        request_batch_slices=[(f"s{i}", model_id, i, i + 1, False, 0) for i in range(n)])


def test_precompile_leaves_nothing_to_compile(tiny_dirs):
    backend = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(
        max_lora_adapters=4, max_lora_rank=4, max_seq_len=MAX_SEQ, train_micro_batch_tokens=BUDGET,
        max_num_seqs=2, prefill_rows=4, prefill_chunk=16))
    backend.create_model("tenant", types.LoraConfig(rank=4, seed=1))
    backend.create_model("no-head", types.LoraConfig(rank=4, seed=2, train_unembed=False))
    lora_before = backend.grad_sum_of("tenant")
    summary = precompile(backend, backend)
    assert not backend.has_model(SCRATCH)
    shapes = model_pass_shapes(MAX_SEQ, BUDGET, 0, 1)
    # grads + accumulate per shape, for adapters with and without a LoRA LM head
    assert summary["compiled"]["forward_backward"] == 2 * 2 * len(shapes)
    assert summary["sample_slot_counts"] == [1, 2]
    for k, v in backend.grad_sum_of("tenant").items():  # the tenant's state is untouched
        np.testing.assert_array_equal(v, lora_before[k])
    compiled = dict(backend.metrics.compiles)
    rng = np.random.default_rng(1)
    for _ in range(4):
        lengths = rng.integers(1, MAX_SEQ + 1, int(rng.integers(1, 6))).tolist()
        for model_id in ("tenant", "no-head"):
            out = backend.forward_backward(_train(lengths, model_id, rng))["fb"]
            assert isinstance(out, types.ForwardBackwardOutput), out
        res = backend.sample(_sample(int(rng.integers(1, 4)), "tenant", rng))
        assert all(isinstance(r, types.SampleOutput) for r in res.values()), res
    assert backend.metrics.compiles == compiled, "a program compiled after --precompile"
