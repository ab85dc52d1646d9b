"""The shapes of the paged engine's device calls: decode slot counts, prefill rows and widths, attention blocks
and their buckets, whether decode runs the layers unrolled. Pure functions of the config, the platform and a
call's rows: `PagedDevice` (tx/sampling/paged_calls.py) picks each call's shape with them, and precompile
(tx/backends/precompile.py) walks the same functions to compile every program a config implies.
"""

from __future__ import annotations

from tx.runtime import pow2


# slot counts above this also come in steps of an octave (`slot_count`); at or below it (the default
# max_num_seqs) every count is a power of 2, so a service at the defaults keeps its few programs (200 random
# requests: 12), and an RL rollout's 512 rows shrinking to 0 run 0.3% more slot-steps than from 32 rows
SLOT_STEPS_FROM = 64


def slot_count(live: int, max_num_seqs: int, fsdp: int, steps: int = 1) -> int:
    """Decode slots of a call with `live` rows: a power of two, with `steps` > 1 above `SLOT_STEPS_FROM` also
    the counts that split each octave into `steps` even steps (2: 96, 192, 384, ...; 4: also 80, 112, 160,
    224, 320, 448, ...), at most `max_num_seqs`, rounded up to the fsdp size. Every slot costs its
    compute until the call returns: where decode is compute-bound (`slot_steps`) the finer steps cut the padded
    slots of a shrinking batch (an RL rollout's rows ending at different max_tokens) from up to half to up to
    a third (2) or a fifth (4), for `steps - 1` more programs per octave where batches are that large."""
    s = pow2(live)
    if steps > 1 and live > SLOT_STEPS_FROM:
        half = s // 2
        s = half + -(-(live - half) * steps // half) * (half // steps)
    s = min(s, max_num_seqs)
    return -(-s // fsdp) * fsdp


def slot_counts(max_num_seqs: int, fsdp: int, steps: int = 1) -> list[int]:
    """Every decode slot count `slot_count` gives for 1 .. max_num_seqs live rows, ascending."""
    return sorted({slot_count(n, max_num_seqs, fsdp, steps) for n in range(1, max_num_seqs + 1)})


SLOT_STEPS = {"pow2": 1, "three_quarters": 2, "eighths": 4}


def slot_steps(setting: str, platform: str) -> int:
    """Into how many steps slot counts split each octave above `SLOT_STEPS_FROM` (`decode_slot_counts`; "auto":
    eighths on CPU, where a decode step's matmuls are compute-bound from a few dozen rows, so a padded slot costs
    its FLOPs; powers of 2 on accelerators, whose decode step at these batches mostly reads weights, and each
    count is a compile)."""
    if setting == "auto":
        setting = "eighths" if platform == "cpu" else "pow2"
    return SLOT_STEPS[setting]


def prefill_row_count(wanted: int, prefill_rows: int, fsdp: int) -> int:
    """Rows of a prefill call whose prompts want `wanted` chunks: a power of two (few programs, at most half
    padding), at most `prefill_rows`, rounded up to the fsdp size."""
    r = min(pow2(wanted), prefill_rows)
    return -(-r // fsdp) * fsdp


def prefill_width(longest: int, rows: int, chunk: int) -> int:
    """Tokens per row of a prefill call whose rows write at most `longest` tokens: a one-row call narrows to a
    quarter or half of `chunk` where they fit (a short prompt alone, or the rest of one the prefix cache mostly
    holds: the call is its first token's latency, and 15 tokens on a 64-wide chunk computed 4x their work); more
    rows take the whole chunk. At most two more programs."""
    if rows == 1:
        for width in (chunk // 4, chunk // 2):
            if width >= 1 and longest <= width:
                return width
    return chunk


def kv_block_for(setting: int | None, page: int, platform: str) -> int:
    """Tokens per attention block (`kv_block`; None: 32 on CPU, 64 elsewhere, rounded up to whole pages)."""
    if setting is not None:
        return setting
    return -(-(32 if platform == "cpu" else 64) // page) * page


# A prefill call's queries (its chunks' tokens) meet their keys in larger blocks than one decode token: on
# CPU each block's pass copies the chunks' queries and running sums, so 4 blocks of 32 for a 128-token
# prompt cost more than 1 of 128 (64 x 128-token prompts: 1.03x a whole call, docs/performance.md).
PREFILL_KV_BLOCK = {"cpu": 128}


def prefill_kv_block(kv_block: int, page: int, platform: str, impl: str) -> int:
    """Tokens per attention block of a prefill call: "blocked" attention on CPU at least `PREFILL_KV_BLOCK`
    (whole pages), else decode's `kv_block`."""
    least = PREFILL_KV_BLOCK.get(platform, 0) if impl == "blocked" else 0
    return max(kv_block, -(-least // page) * page)


def table_blocks(width: int, page: int, kv_block: int) -> int:
    """Attention blocks a table of `width` pages spans: no call needs more."""
    return -(-width * page // kv_block)


def block_bucket(last_pos: int, kv_block: int, max_blocks: int) -> int:
    """The attention block count of a bucketed decode call whose furthest input sits at `last_pos`: the
    blocks it needs, rounded up to a power of two, at most the table's `max_blocks`."""
    return min(pow2(last_pos // kv_block + 1), max_blocks)


def kv_blocks_bucketed(setting: str, platform: str) -> bool:
    """Whether the host picks the attention's block count per call (`paged_kv_blocks`; "auto": on GPUs,
    where a data-dependent loop waits for the host at every block of every layer)."""
    return setting == "bucketed" or (setting == "auto" and platform in ("cuda", "rocm"))


def decode_layers_unrolled(setting: str, platform: str, devices: int, layer_bytes: int, free_bytes: int) -> bool:
    """Whether decode calls run the layers one by one on per-layer copies of their weights, made once and
    kept (`paged_decode_layers`, tx/sampling/layer_copies.py; "auto": on one CPU or NVIDIA GPU device, when
    the copy, `layer_bytes`, is at most a quarter of `free_bytes`. Measured on an H100 at the Qwen3-1.7B
    shape: 1.31x decode tokens/s at batch 1 and 1.70x at batch 64, the same greedy tokens (HOPPER.md). Not on
    TPUs, whose matmuls read a scanned layer's slice in place, nor on ROCm (unmeasured), nor over several
    devices, where each layer's weights are gathered per layer and step under the scan). One device means
    one process, so "auto" needs no agreement between hosts."""
    fits = 4 * layer_bytes <= free_bytes
    return setting == "unrolled" or (setting == "auto" and platform in ("cpu", "cuda") and devices == 1 and fits)
