"""`--precompile`: compile, at start-up, the programs a configuration implies, so no tenant's call waits for
a compile later (with the persistent compilation cache, a restart then reads them from disk).

What is compiled, by running each program once on a scratch adapter (created, then deleted; nothing else
is touched):
- forward_backward, per loss function given (a pass evaluates only the losses of its rows, so a call that
  mixes losses compiles that set's pass at first use) and for adapters that train the LM head and those that do not
  (the latter skip its LoRA delta): its "grads" and "accumulate" programs at every padded
  micro-batch shape (`batching.model_pass_shapes`: lengths bucketed 16, 24, 32, 48, 64, 96, ... up to
  max_seq_len, so padding stays under 50% with a logarithmic number of shapes; rows in powers of two times
  the fsdp size within `train_micro_batch_tokens` / `train_micro_batch_size`, since the planner packs rows
  into micro-batches under that budget).
- the paged sampling engine: the decode program at every slot count (`call_shapes.slot_counts`: the live rows
  are padded to one; n samples of one prompt, long enough that all n decode together however few prompts a
  prefill call takes) and the prefill program at every row count one
  iteration's admissions can want (powers of 2 up to `prefill_rows`: up to `max_num_seqs` prompts of up to
  max_seq_len - 2 tokens, `prefill_prompt_lengths`) and, for one row, at every width it narrows to
  (`one_row_prefill_prompts`), for rows with the default stops, no top-k log-probs
  and no repetition penalty. Where the host picks the attention's block count (`paged_kv_blocks`,
  bucketed on GPUs), every slot count at every block bucket: rows of one prompt per bucket, long enough
  to reach it (the prompt is prefilled once per bucket and then read from the prefix cache).
Not compiled ahead: `forward` (no gradients), prompt log-probs, top-k sample log-probs, repetition
penalties; they compile at first use (and are cached on disk like every program).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from tx import types
from tx.backends.batching import model_pass_shapes
from tx.sampling.call_shapes import (block_bucket, kv_block_for, kv_blocks_bucketed, prefill_row_count, prefill_width,
                                     slot_counts, slot_steps, table_blocks)
from tx.sampling.kv_cache import table_width

logger = logging.getLogger(__name__)

SCRATCH = "__precompile__"


def prefill_prompt_lengths(max_seq_len: int, chunk: int, prefill_rows: int, max_num_seqs: int, fsdp: int
                           ) -> list[list[int]]:
    """For each prefill row count (`call_shapes.prefill_row_count`) but one chunk's (the slot-count runs
    prefill one one-chunk prompt), the lengths of prompts whose first prefill call takes it: one iteration
    admits up to `max_num_seqs` one-sample requests, each prompt spanning at most the chunks of one with 2 new
    tokens (max_seq_len - 2 tokens, every one prefilled)."""
    per_prompt = max(1, (max_seq_len - 3) // chunk + 1)
    most = max_num_seqs * per_prompt
    reached = {prefill_row_count(1, prefill_rows, fsdp)}
    wanted: dict[int, int] = {}  # row count -> the most chunks that take it
    for w in range(1, most + 1):
        wanted[prefill_row_count(w, prefill_rows, fsdp)] = w
    out = []
    for rows in sorted(set(wanted) - reached):
        w = wanted[rows]
        chunks = [per_prompt] * (w // per_prompt) + ([w % per_prompt] if w % per_prompt else [])
        out.append([(c - 1) * chunk + 1 for c in chunks])  # c chunks: (c - 1) * chunk + 1 tokens
    return out


def one_row_prefill_prompts(max_seq_len: int, chunk: int) -> dict[int, int]:
    """Each width a one-row prefill call can take (`call_shapes.prefill_width`) -> the length of a prompt alone
    whose prefill takes it. The row writes 1 .. chunk tokens, at most those of the longest prompt with 2 new
    tokens (max_seq_len - 2 tokens, every one prefilled)."""
    most = min(chunk, max_seq_len - 2)
    prompts: dict[int, int] = {}
    for n in range(1, most + 1):
        prompts[prefill_width(n, 1, chunk)] = n  # the most tokens each width takes
    return dict(sorted(prompts.items()))


def decode_block_prompts(max_seq_len: int, page: int, kv_block: int) -> list[int]:
    """For each attention block bucket a bucketed decode call can run, the shortest prompt whose rows' first
    decode call runs it when they sample 2 tokens (their furthest input sits at the prompt's length)."""
    max_blocks = table_blocks(table_width(max_seq_len, page), page, kv_block)
    # an input's position is at most max_seq_len - 2 (prompt + max_tokens <= max_seq_len)
    candidates = [2] + list(range(kv_block, max_seq_len - 1, kv_block)) + [max_seq_len - 2]
    first: dict[int, int] = {}
    for length in candidates:
        if 2 <= length <= max_seq_len - 2:
            first.setdefault(block_bucket(length, kv_block, max_blocks), length)
    return sorted(first.values())


def _train_batch(rows: int, length: int, loss_fn: str, vocab: int, rng: np.random.Generator
                 ) -> types.PreparedModelPassBatch:
    ids = rng.integers(0, vocab, (rows, length)).tolist()
    zeros = [[0.0] * length] * rows
    return types.PreparedModelPassBatch(
        all_input_ids=ids, all_targets=ids, all_token_weights=[[1.0] * length] * rows, all_sampling_logprobs=zeros,
        all_advantages=zeros, all_model_ids=[SCRATCH] * rows, all_loss_fns=[loss_fn] * rows,
        all_loss_fn_configs=[None] * rows, request_batch_slices=[("precompile", SCRATCH, 0, rows)])


def _sample_batch(lengths: list[int], vocab: int, rng: np.random.Generator) -> types.PreparedSampleBatch:
    prompts = [rng.integers(3, vocab, n).tolist() for n in lengths]  # distinct: no prefix-cache hits
    n = len(prompts)
    return types.PreparedSampleBatch(
        all_prompts=prompts, all_sampling_params=[types.SamplingParams(max_tokens=2, seed=i) for i in range(n)],
        all_model_ids=[SCRATCH] * n, all_checkpoint_ids=[""] * n, all_checkpoint_paths=[""] * n,
        request_batch_slices=[(f"precompile-{i}", SCRATCH, i, i + 1, False, 0) for i in range(n)])


def _one_prompt_batch(n: int, prompt: list[int], per_request: int, max_tokens: int = 2) -> types.PreparedSampleBatch:
    """`n` samples of `prompt`, `max_tokens` each (no stop tokens: every row runs that long), in requests of at
    most `per_request` (`max_num_samples`) samples: `n` decode rows, one prefill per request."""
    slices = [(f"precompile-{i}", SCRATCH, i, min(i + per_request, n), False, 0) for i in range(0, n, per_request)]
    params = types.SamplingParams(max_tokens=max_tokens, seed=0, stop=[])
    return types.PreparedSampleBatch(
        all_prompts=[prompt] * n, all_sampling_params=[params] * n,
        all_model_ids=[SCRATCH] * n, all_checkpoint_ids=[""] * n, all_checkpoint_paths=[""] * n,
        request_batch_slices=slices)


def _failed(results: dict, what: str) -> None:
    bad = [r for r in results.values() if isinstance(r, types.ErrorResponse)]
    if bad:
        raise RuntimeError(f"precompile {what}: {bad[0].error}")


def precompile(backend: Any, impl: Any, loss_fns: tuple[str, ...] = ("cross_entropy",)) -> dict:
    """Run every program the module docstring lists once through `backend` (a JaxBackend, or the
    DistributedBackend whose calls every host runs); `impl` is the local JaxBackend (its configuration
    and mesh). Returns what it compiled and how long it took; logs the same."""
    cfg, fsdp = impl.config, impl.mesh.shape["fsdp"]
    vocab = impl.model.config.vocab_size
    shapes = model_pass_shapes(impl.max_seq_len, cfg.train_micro_batch_tokens, cfg.train_micro_batch_size, fsdp)
    counts = slot_counts(cfg.max_num_seqs, fsdp, slot_steps(cfg.decode_slot_counts, impl.model.platform))
    bucketed = cfg.paged_attention_impl == "blocked" and kv_blocks_bucketed(cfg.paged_kv_blocks, impl.model.platform)
    kv_block = kv_block_for(cfg.kv_block, cfg.kv_page_size, impl.model.platform)
    block_prompts = decode_block_prompts(impl.max_seq_len, cfg.kv_page_size, kv_block) if bucketed else []
    width_prompts = one_row_prefill_prompts(impl.max_seq_len, cfg.prefill_chunk)
    prefill_sets = prefill_prompt_lengths(impl.max_seq_len, cfg.prefill_chunk, cfg.prefill_rows, cfg.max_num_seqs,
                                          fsdp)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    before = dict(impl.metrics.compiles)
    backend.create_model(SCRATCH, types.LoraConfig(rank=cfg.max_lora_rank, seed=0, train_unembed=False))
    try:
        # passes over adapters that train the LM head and passes over adapters that do not (which skip the
        # head's LoRA delta) are different programs: the scratch adapter runs every shape both ways
        work = [(head, loss, shape) for head in (False, True) for loss in loss_fns for shape in shapes]
        trains_head = False
        for head, loss, (rows, seq, length) in tqdm(work, desc="precompile forward_backward", disable=None):
            if head and not trains_head:
                backend.delete_model(SCRATCH)
                backend.create_model(SCRATCH, types.LoraConfig(rank=cfg.max_lora_rank, seed=0))
                trains_head = True
            # 2 x rows rows in two micro-batches of `rows`: the "grads" program, then the "accumulate" one
            plan = [list(range(rows)), list(range(rows, 2 * rows))]
            _failed(backend.forward_backward_planned(_train_batch(2 * rows, length, loss, vocab, rng), plan),
                    f"forward_backward {loss} at {rows} x {seq}")
        train_s = time.perf_counter() - start
        prompt_len = max(2, min(cfg.prefill_chunk, impl.max_seq_len - 2))
        for n in tqdm(counts, desc="precompile sampling", disable=None):
            # n samples of one prompt (one prefill per request of max_num_samples); they must all be live in
            # one decode call: while requests wait to be prefilled (prefill_rows one-chunk prompts an
            # iteration), each iteration decodes decode_steps_per_call tokens, so the first rows' max_tokens
            # outlasts those iterations
            requests = -(-n // cfg.max_num_samples)
            rounds = -(-requests // cfg.prefill_rows)
            max_tokens = min(2 + cfg.decode_steps_per_call * (rounds - 1), impl.max_seq_len - prompt_len)
            prompt = rng.integers(3, vocab, prompt_len).tolist()
            _failed(backend.sample(_one_prompt_batch(n, prompt, cfg.max_num_samples, max_tokens)),
                    f"sampling {n} rows")
        for length in tqdm(width_prompts.values(), desc="precompile one-row prefill widths", disable=None):
            _failed(backend.sample(_sample_batch([length], vocab, rng)), f"prefilling a {length}-token prompt")
        for lengths in tqdm(prefill_sets, desc="precompile prefill rows", disable=None):
            _failed(backend.sample(_sample_batch(lengths, vocab, rng)), f"prefilling prompts of {lengths} tokens")
        prompts = [rng.integers(3, vocab, length).tolist() for length in block_prompts]
        work = [(n, prompt) for prompt in prompts for n in counts]
        for n, prompt in tqdm(work, desc="precompile decode block buckets", disable=None):
            _failed(backend.sample(_one_prompt_batch(n, prompt, cfg.max_num_samples)),
                    f"sampling {n} rows of a {len(prompt)}-token prompt")
    finally:
        backend.delete_model(SCRATCH)
    compiled = {k: v - before.get(k, 0) for k, v in impl.metrics.compiles.items() if v != before.get(k, 0)}
    summary = {"forward_backward_shapes": len(shapes), "loss_fns": list(loss_fns), "sample_slot_counts": counts,
               "one_row_prefill_widths": list(width_prompts),
               "prefill_prompt_lengths": prefill_sets, "decode_block_prompts": block_prompts,
               "compiled": compiled, "train_s": round(train_s, 1), "total_s": round(time.perf_counter() - start, 1)}
    logger.info("precompiled %s", summary)
    return summary
