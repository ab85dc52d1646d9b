"""The paged calls' shapes (tx/sampling/call_shapes.py), against rules derived from their docs: the smallest
allowed count at or above what a call needs, by brute force over every input."""

from __future__ import annotations

import pytest

from tx.sampling.call_shapes import (block_bucket, decode_layers_unrolled, kv_blocks_bucketed, prefill_row_count,
                                     slot_count, slot_counts, slot_steps, table_blocks)


def test_slot_counts():
    assert slot_counts(64, 1) == [1, 2, 4, 8, 16, 32, 64]
    assert slot_counts(48, 1) == [1, 2, 4, 8, 16, 32, 48]
    assert slot_counts(8, 4) == [4, 8]
    # with three quarters of a power of 2 above 64 rows; up to 64 (the default max_num_seqs) powers of 2 only
    assert slot_counts(64, 1, steps=2) == slot_counts(64, 1, steps=4) == [1, 2, 4, 8, 16, 32, 64]
    assert slot_counts(72, 1, steps=2) == [1, 2, 4, 8, 16, 32, 64, 72]
    assert slot_counts(512, 1, steps=2) == [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert slot_counts(100, 8, steps=2) == [8, 16, 32, 64, 96, 104]  # 100 rounded up to the fsdp size
    # eighths of an octave above 64 rows (the CPU's default)
    assert slot_counts(512, 1, steps=4) == [1, 2, 4, 8, 16, 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320,
                                            384, 448, 512]
    assert slot_counts(100, 8, steps=4) == [8, 16, 32, 64, 80, 96, 104]
    assert [slot_steps(s, p) for s, p in [("auto", "cpu"), ("auto", "cuda"), ("auto", "tpu"), ("pow2", "cpu"),
                                           ("three_quarters", "cuda"), ("eighths", "tpu")]] == [4, 1, 1, 1, 2, 4]


def test_kv_blocks_auto_means_bucketed_on_gpus_only():
    assert [kv_blocks_bucketed("auto", p) for p in ("cpu", "tpu", "cuda", "rocm")] == [False, False, True, True]
    assert kv_blocks_bucketed("bucketed", "cpu") and not kv_blocks_bucketed("dynamic", "cuda")


@pytest.mark.parametrize("max_num_seqs,fsdp,steps", [(64, 1, 4), (512, 1, 4), (512, 1, 2), (100, 8, 4), (300, 2, 1)])
def test_slot_count_is_the_smallest_allowed_count_that_holds_the_rows(max_num_seqs, fsdp, steps):
    """Allowed: powers of two, and above 64 rows each octave [p, 2p) split into `steps` even steps; capped at
    max_num_seqs, rounded up to the fsdp size. A call takes the smallest allowed count holding its rows."""
    allowed = set()
    p = 1
    while p <= 2 * max_num_seqs:
        allowed.add(p)
        if p >= 64 and steps > 1:
            allowed |= {p + j * p // steps for j in range(1, steps)}
        p *= 2
    allowed = {-(-min(n, max_num_seqs) // fsdp) * fsdp for n in allowed}
    for live in range(1, max_num_seqs + 1):
        want = min(n for n in allowed if n >= min(live, max_num_seqs))
        assert slot_count(live, max_num_seqs, fsdp, steps) == want, live
    assert slot_counts(max_num_seqs, fsdp, steps) == sorted({slot_count(n, max_num_seqs, fsdp, steps)
                                                            for n in range(1, max_num_seqs + 1)})


def test_prefill_rows_and_block_buckets():
    assert [prefill_row_count(w, 16, 1) for w in (1, 2, 3, 5, 9, 16, 17, 100)] == [1, 2, 4, 8, 16, 16, 16, 16]
    assert [prefill_row_count(w, 16, 4) for w in (1, 3, 5)] == [4, 4, 8]  # whole fsdp groups
    assert table_blocks(10, 16, 32) == 5 and table_blocks(10, 16, 64) == 3  # 160 tokens
    # the blocks a call needs (last_pos // kv_block + 1) rounded up to a power of two, at most the table's
    for last_pos in range(0, 400):
        need = last_pos // 32 + 1
        assert block_bucket(last_pos, 32, 9) == min(1 << (need - 1).bit_length(), 9), last_pos


def test_decode_layers_unrolled_where_a_copy_fits_a_quarter_of_one_cpu_or_nvidia_device():
    assert decode_layers_unrolled("auto", "cpu", 1, 100, 400) and decode_layers_unrolled("auto", "cuda", 1, 100, 400)
    assert not decode_layers_unrolled("auto", "cpu", 1, 101, 400)  # over a quarter of the free memory
    assert not decode_layers_unrolled("auto", "cuda", 2, 1, 400)  # several devices: the scan
    assert not decode_layers_unrolled("auto", "tpu", 1, 1, 400)
    assert not decode_layers_unrolled("auto", "rocm", 1, 1, 400)  # unmeasured there
    assert decode_layers_unrolled("unrolled", "tpu", 8, 10**12, 1)  # asked for: as asked
    assert not decode_layers_unrolled("scan", "cpu", 1, 1, 400)
