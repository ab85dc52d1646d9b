"""Device programs of the paged sampling engine (`tx/sampling/continuous.py` drives them).

- `prefill_chunk`: `[R, C]` prompt tokens (each row a chunk of one prompt, at absolute positions) write
  their keys/values into the page pools; a row holding its prompt's last token also writes that token's
  final hidden state into the first-token buffer (`firsts_nd`, at `first_r`), from which the prompt's rows
  choose their first tokens. Only that token runs the last layer past its keys/values (`last_at_r`). It runs
  on decode's kept per-layer copies where they exist, its layers in turn (`DecoderStack._paged`); a scan
  would slice every layer's weights out of the stacks per call (as much as a small chunk's matmuls).
- `copy_pages`: page `src[m]` -> page `dst[m]` in every layer (copy-on-write of a shared partial page).
- `decode_steps`: first the copies newly admitted slots need (one pair per slot, no program of its own),
  then up to `bound` tokens for every active slot, in one `lax.while_loop` that also ends once every slot
  has stopped. A slot starting its row (`first_s`) takes its first step's hidden state from the first-token
  buffer instead of running its input (the prompt's last token, already written) through the layers; a first
  step where every active slot does so runs no layers at all. `steps` (static) sizes the output buffers;
  `bound` <= `steps` is a traced value the host picks per call (few steps while requests wait to join,
  `steps` when none waits), so it adds no program.
  Each step feeds each slot's input token at its position, takes float32 logits, selects the next token
  with the slot's parameters and the key `fold_in(key(seed), gen)` (gen = tokens the row generated so far,
  so a row's tokens depend on neither its batch nor its slot nor preemption), and stops a slot on a stop token,
  when its last generated tokens equal one of its stop sequences (a rolling window carried through the
  loop), or at `max_tokens`. Besides the tokens it returns the slots' state at its end (`Carry`), from
  which the host may start the next call over the same slots before reading this one's results. Where the
  host sends `SlotInputs.prefix`, attention reads the pages rows share once per segment of rows
  (tx/kernels/shared_prefix.py); the plan holds for every step of the call (shared pages stay shared).

All shapes are fixed by the engine's configuration (slot bucket, steps, stop width, top-k width, and the
attention's `kv_blocks` bucket when the host picks it), never by request values. The pools are donated:
they are updated in place.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tx.kernels.row_groups import group_count, map_row_groups
from tx.kernels.shared_prefix import SharedPrefix
from tx.sampling.filters import choose, mark_present
from tx.sampling.layer_copies import Copies, layer_states

Pools = list[tuple[jax.Array, ...]]  # per layer stack: its pools (`kv_layout`)

# A decode call's token choice (`filters.choose`) works on `[slots, vocab]` float32 arrays: the top-k / top-p
# branch holds five at once, which the program's temporary buffer is sized for whether a call filters or not
# (317 MB at 512 slots and a 32k vocabulary). On CPU it runs over groups of slots of at most this many entries
# in turn (4 groups of 128 slots there), which leaves the attention's buffers the largest: 188 MB. Smaller
# groups save nothing more and cost time (groups of 32 slots: ~5% slower calls); a row's choice is the same
# bits either way. One device only: not measured where the slots are sharded.
CHOICE_GROUP_ENTRIES = {"cpu": 2**22}


class PrefillInputs(NamedTuple):
    ids_rc: jax.Array  # int32 [R, C]
    pos_rc: jax.Array  # int32 [R, C] absolute positions (0 on padding)
    valid_rc: jax.Array  # bool [R, C]
    adapter_r: jax.Array  # int32 [R]
    table_rw: jax.Array  # int32 [R, W]
    first_r: jax.Array  # int32 [R]: the first-token buffer's row for this row's last valid token (past its end: none)


class SlotInputs(NamedTuple):
    token_s: jax.Array  # int32 [S]: the next input token
    pos_s: jax.Array  # int32 [S]: its position
    gen_s: jax.Array  # int32 [S]: tokens generated so far
    active_s: jax.Array  # bool [S]
    adapter_s: jax.Array  # int32 [S]
    seed_s: jax.Array  # uint32 [S]
    temperature_s: jax.Array  # float32 [S]
    top_k_s: jax.Array  # int32 [S]
    top_p_s: jax.Array  # float32 [S]
    max_tokens_s: jax.Array  # int32 [S]
    stop_sx: jax.Array  # int32 [S, x], -1 = unused
    table_sw: jax.Array  # int32 [S, W]
    copy_src_s: jax.Array  # int32 [S]: a newly admitted slot's copy of its prompt's partial page (0 = none)
    copy_dst_s: jax.Array  # int32 [S]
    min_p_s: jax.Array  # float32 [S] (0 = off)
    penalty_s: jax.Array  # float32 [S] repetition penalty (1 = off)
    first_s: jax.Array  # int32 [S]: a slot starting its row: its first-token buffer row (-1 = none)
    presence_sv: jax.Array | None  # bool [S, vocab]: tokens of each row's prompt and output (only with a penalty)
    # stop strings as token sequences (only when a row has one): each row's, right-aligned, -1 before them,
    # and its last generated tokens so far (right-aligned, -1 where it has fewer)
    stop_seq_sxl: jax.Array | None = None  # int32 [S, x, l]
    recent_sl: jax.Array | None = None  # int32 [S, l]
    # the pages rows share, read once per segment of rows (tx/sampling/prefix_segments.py); None: each row its own
    prefix: SharedPrefix | None = None


class Carry(NamedTuple):
    """A decode call's slot state at its end: the inputs a next call over the same slots continues from
    without the host (`PagedDevice.decode`'s `after`)."""

    token_s: jax.Array  # int32 [S]: each slot's next input token
    pos_s: jax.Array
    gen_s: jax.Array
    active_s: jax.Array  # bool [S]: rows still running
    presence_sv: jax.Array | None
    recent_sl: jax.Array | None


class StepOutputs(NamedTuple):
    tokens_sk: jax.Array  # int32 [S, steps]
    logprobs_sk: jax.Array  # float32 [S, steps]
    new_s: jax.Array  # int32 [S]: tokens produced in this call
    done_s: jax.Array  # bool [S]: the row ended in this call
    hit_stop_s: jax.Array  # bool [S]: ... on a stop token
    top_ids_skq: jax.Array | None  # int32 [S, steps, q] with top-k
    top_logprobs_skq: jax.Array | None
    carry: Carry
    forwards: jax.Array  # int32: steps that ran the layers


def prefill_chunk(model, pools: Pools, firsts_nd: jax.Array, inp: PrefillInputs, layers: list | None, impl: str,
                  kv_block: int, layer_defs: tuple | None = None) -> tuple[Pools, jax.Array]:
    """`layers` / `layer_defs`: as `decode_steps` (unrolled on the kept per-layer copies); None scans the stacks.
    Returns the pools and the first-token buffer (both donated)."""
    if layers is not None:
        layers = layer_states(layer_defs, layers)
    last_r = jnp.maximum(jnp.sum(inp.valid_rc, axis=1) - 1, 0)
    hidden_r1d, pools = model.paged_forward(inp.ids_rc, inp.pos_rc, inp.valid_rc, inp.adapter_r, pools, inp.table_rw,
                                            impl, kv_block, None, layers, last_at_r=last_r)
    firsts_nd = firsts_nd.at[inp.first_r].set(hidden_r1d[:, 0].astype(firsts_nd.dtype), mode="drop")
    return pools, firsts_nd


def copy_pages(pools: Pools, src_m: jax.Array, dst_m: jax.Array) -> Pools:
    """Copy pages (all layers); pairs (0, 0) are no-ops on the trash page."""
    return [tuple(pool.at[:, dst_m].set(pool[:, src_m]) for pool in stack) for stack in pools]


def ends_with_a_sequence(recent_sl: jax.Array, seq_sxl: jax.Array) -> jax.Array:
    """bool [S]: whether each row's recent tokens end with one of its sequences (right-aligned, -1 before
    a sequence; an all -1 entry is no sequence). A -1 in the window (fewer tokens so far) matches nothing."""
    used_sxl = seq_sxl >= 0
    match_sx = jnp.all((recent_sl[:, None, :] == seq_sxl) | ~used_sxl, axis=-1)
    return jnp.any(match_sx & jnp.any(used_sxl, axis=-1), axis=-1)


def slot_keys(seed_s: jax.Array, gen_s: jax.Array) -> jax.Array:
    """One key per slot: `filters.row_keys(seed, step)` with each row's own step."""
    return jax.vmap(lambda s, g: jax.random.fold_in(jax.random.key(s), g))(seed_s.astype(jnp.uint32), gen_s)


def decode_steps(model, pools: Pools, firsts_nd: jax.Array, inp: SlotInputs, bound: jax.Array, copies: Copies | None,
                 steps: int, topk: int, impl: str, kv_block: int, kv_blocks: int | None = None,
                 layer_defs: tuple | None = None) -> tuple[Pools, StepOutputs]:
    s = inp.token_s.shape[0]
    # `copies` (unrolled decode): per stack, its weights one layer at a time as leaves of `layer_defs`
    # (tx/sampling/layer_copies.py); each step runs the layers one by one on them. None: the model's stacks
    # under `lax.scan`. Its `[vocab, d]` head (CPU), where given (programs of two or more rows: the caller
    # asks for it then), replaces the model's kernel.
    layers, head_vd = None, None
    if copies is not None:
        layers, head_vd = layer_states(layer_defs, copies.stacks), copies.head_vd
    # before any slot reads its pages; the page ids go to every device (each fsdp replica of the pools copies
    # every pair locally, instead of gathering the copied pages of the other rows' shards)
    src_s, dst_s = (model.layout.constrain(x, (None,)) for x in (inp.copy_src_s, inp.copy_dst_s))
    pools = copy_pages(pools, src_s, dst_s)

    penalized = inp.presence_sv is not None
    sequences = inp.stop_seq_sxl is not None
    most = CHOICE_GROUP_ENTRIES.get(model.platform) if model.layout.one_device else None

    hidden_dtype = model.embed_tokens.embedding[...].dtype
    # the starting slots' kept states (rows without one read row 0: unused), gathered once for the first step
    prefilled_s1d = firsts_nd[jnp.maximum(inp.first_s, 0)][:, None, :].astype(hidden_dtype)

    def cond(state):
        return (state[0] < jnp.minimum(bound, steps)) & jnp.any(state[5])

    def choose_rows(logits_sv, keys_s, temperature_s, top_k_s, top_p_s, min_p_s, penalty_s, presence_sv):
        return choose(logits_sv, keys_s, temperature_s, top_k_s, top_p_s, topk, min_p_s, penalty_s, presence_sv)

    def body(state):
        (k, forwards, pools, token_s, pos_s, active_s, gen_s, tokens_sk, logprobs_sk, hit_s, presence_sv, recent_sl,
         *top) = state
        # a stopped slot's query sits at position 0: its K/V goes to the trash page, and its attention does not
        # extend the loop over KV blocks the active rows need (each row's result is independent of the count)
        at_s = jnp.where(active_s, pos_s, 0)
        # a slot starting its row: its input's K/V is written (by the prefill), its hidden state kept
        first_s = active_s & (k == 0) & (inp.first_s >= 0)

        def forward(c):
            n, pools, _ = c
            hidden_s1d, pools = model.paged_forward(token_s[:, None], at_s[:, None], (active_s & ~first_s)[:, None],
                                                    inp.adapter_s, pools, inp.table_sw, impl, kv_block, kv_blocks,
                                                    layers, inp.prefix)
            return n + 1, pools, hidden_s1d.astype(hidden_dtype)

        # the layers run once, or not at all where every active slot starts its row: a loop of 0 or 1 turns, not
        # a `lax.cond`, whose branches XLA gives copies of the donated pools
        runs = jnp.where(jnp.all(first_s | ~active_s), 0, 1)
        ran, pools, hidden_s1d = jax.lax.while_loop(lambda c: c[0] < runs, forward,
                                                    (jnp.int32(0), pools, prefilled_s1d))
        forwards = forwards + ran
        hidden_s1d = jnp.where(first_s[:, None, None], prefilled_s1d, hidden_s1d)
        logits_sv = model.logits(hidden_s1d, inp.adapter_s, head_vd)[:, 0]
        per_slot = (logits_sv, slot_keys(inp.seed_s, gen_s), inp.temperature_s, inp.top_k_s, inp.top_p_s,
                    inp.min_p_s, inp.penalty_s if penalized else None, presence_sv)
        next_s, logprob_s, chosen_top = map_row_groups(choose_rows, per_slot, group_count(s, logits_sv.shape[-1], most))
        if penalized:
            presence_sv = mark_present(presence_sv, next_s, active_s)
        if topk:
            top = [top[0].at[:, k].set(chosen_top[0]), top[1].at[:, k].set(chosen_top[1])]
        tokens_sk = tokens_sk.at[:, k].set(jnp.where(active_s, next_s, 0))
        logprobs_sk = logprobs_sk.at[:, k].set(jnp.where(active_s, logprob_s, 0.0))
        gen_s = gen_s + active_s
        stop_s = active_s & jnp.any(inp.stop_sx == next_s[:, None], axis=-1)
        if sequences:
            recent_sl = jnp.concatenate([recent_sl[:, 1:], next_s[:, None]], axis=1)
            stop_s = stop_s | (active_s & ends_with_a_sequence(recent_sl, inp.stop_seq_sxl))
        hit_s = hit_s | stop_s
        ended_s = active_s & (stop_s | (gen_s >= inp.max_tokens_s))
        return (k + 1, forwards, pools, next_s, pos_s + active_s, active_s & ~ended_s, gen_s, tokens_sk, logprobs_sk,
                hit_s, presence_sv, recent_sl, *top)

    state = (jnp.int32(0), jnp.int32(0), pools, inp.token_s, inp.pos_s, inp.active_s, inp.gen_s,
             jnp.zeros((s, steps), jnp.int32), jnp.zeros((s, steps), jnp.float32), jnp.zeros(s, bool), inp.presence_sv,
             inp.recent_sl)
    if topk:
        state += (jnp.zeros((s, steps, topk), jnp.int32), jnp.zeros((s, steps, topk), jnp.float32))
    (_, forwards, pools, token_s, pos_s, active_s, gen_s, tokens_sk, logprobs_sk, hit_s, presence_sv, recent_sl,
     *top) = jax.lax.while_loop(cond, body, state)
    out = StepOutputs(tokens_sk, logprobs_sk, gen_s - inp.gen_s, inp.active_s & ~active_s, hit_s,
                      *(top or (None, None)), Carry(token_s, pos_s, gen_s, active_s, presence_sv, recent_sl), forwards)
    return pools, out
