"""The paged engine's device side: the KV page pools, and packing the host's rows into the fixed-shape
inputs of `prefill_chunk` and `decode_steps` (tx/sampling/paged_step.py), then the outputs back into rows.

`tx/sampling/continuous.py` decides which prompts and rows run (pages, slots, preemption); this module
only turns its `Group`s (prompts being prefilled) and `Live` rows (decode slots) into arrays. Few shapes
(tx/sampling/call_shapes.py), so few programs: prefill rows go in powers of 2 up to `prefill_rows`, decode
slots in powers of 2 (on CPU, above 64, also eighths of an octave: 80, 96, 112, 160, ...) up to
`max_num_seqs` (both rounded up to the fsdp size: rows are split over its devices), stop lists in powers of
2 >= 8, and top-k has one width.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tx.kernels.shared_prefix import SharedPrefix
from tx.runtime import pow2
from tx.sampling.call_shapes import (block_bucket, decode_layers_unrolled, kv_block_for, kv_blocks_bucketed,
                                     prefill_kv_block, prefill_row_count, prefill_width, slot_count, slot_counts,
                                     slot_steps, table_blocks)
from tx.sampling.first_tokens import FirstTokens
from tx.sampling.kv_pools import make_pools
from tx.sampling.layer_copies import LayerCopies
from tx.sampling.paged_step import PrefillInputs, SlotInputs, StepOutputs, decode_steps, prefill_chunk
from tx.sampling.prefix_segments import plan_segments

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tx.runtime import Runtime
    from tx.sampling.kv_cache import KVCacheManager
    from tx.sampling.paged_rows import Group, Live
    from tx.sampling.source import SamplingSettings, WeightsSource
    from tx.sampling.text import TextCodec


def free_memory_bytes() -> int:
    """This process's first device's free memory, or half the host's where the device does not report it
    (CPU)."""
    import os

    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


@dataclass(eq=False)
class DecodeCall:
    """A dispatched decode call: its rows (slot by slot) and bound, its inputs and outputs on the device."""

    live: list[Live]
    bound: int
    inp: SlotInputs
    out: StepOutputs
    key: tuple  # its program: ("sample_decode", slots, steps, stop width, top-k width, penalized, stop seqs, blocks)

    @property
    def slots(self) -> int:
        return self.inp.token_s.shape[0]


class PagedDevice:
    """Page pools `[layers, pages, page, *entry]` per layer stack (the model's `kv_layout`; created at first use,
    their zero pages then handed back to the system on CPU (`release_zero_pages`); donated to every call) and
    the two device calls over them."""

    def __init__(self, source: WeightsSource, runtime: Runtime, config: SamplingSettings, text: TextCodec,
                 kv: KVCacheManager, stats: dict[str, int], free_bytes: int):
        self.source, self.runtime, self.text = source, runtime, text
        cfg = config
        self.num_pages, self.page, self.width = kv.num_pages, kv.page_size, kv.table_width  # the pools' geometry
        self.slots, self.fsdp = cfg.max_num_seqs, runtime.mesh.shape["fsdp"]
        self.chunk, self.chunk_rows = cfg.prefill_chunk, cfg.prefill_rows
        self.steps = max(cfg.decode_steps_per_call, cfg.max_decode_steps_per_call)  # the buffers' width
        platform = source.model.platform
        self.impl, self.kv_block = cfg.paged_attention_impl, kv_block_for(cfg.kv_block, self.page, platform)
        self.prefill_block = prefill_kv_block(self.kv_block, self.page, platform, self.impl)
        self.max_blocks = table_blocks(self.width, self.page, self.kv_block)
        self.bucketed = self.impl == "blocked" and kv_blocks_bucketed(cfg.paged_kv_blocks, platform)
        # the shared-prefix read's block loop is found on the device (no static count to bucket)
        self.shared_prefix = cfg.paged_shared_prefix and self.impl == "blocked" and not self.bucketed
        self.slot_steps = slot_steps(cfg.decode_slot_counts, platform)
        self.slot_counts = slot_counts(self.slots, self.fsdp, self.slot_steps)  # a decode call's, ascending
        self.topk_width = pow2(cfg.max_topk_prompt_logprobs)  # topk_sample_logprobs are bounded by it
        self.stats = stats
        out_in = platform == "cpu"  # the copies in the layout CPU matmuls read fastest (tx/sampling/layer_copies.py)
        head_dv = source.model.head_kernel() if out_in else None
        copy_bytes = source.model.layer_bytes() + (0 if head_dv is None else head_dv.addressable_shards[0].data.nbytes)
        self.unrolled = decode_layers_unrolled(cfg.paged_decode_layers, platform, runtime.mesh.size, copy_bytes,
                                               free_bytes)
        # said once per engine: the unrolled layout holds a second copy of the layer weights on the device
        logger.info("paged decode: %s (paged_decode_layers=%r, %s x%d; the copies: %.2f GiB%s, free: %.2f GiB); "
                    "attention blocks of %d tokens (kv_block=%r), %d in prefill",
                    "layers unrolled on per-layer weight copies" if self.unrolled else "layer scan over the stacks",
                    cfg.paged_decode_layers, platform, runtime.mesh.size, copy_bytes / 2**30,
                    ", dense kernels and head [out, in]" if out_in else "", free_bytes / 2**30, self.kv_block,
                    cfg.kv_block, self.prefill_block)
        if cfg.paged_shared_prefix and not self.shared_prefix:
            logger.info("paged decode: shared pages are read row by row (paged_shared_prefix needs "
                        "paged_attention_impl='blocked' with the block count found on the device; here %r, %s)",
                        self.impl, "bucketed" if self.bucketed else "dynamic")
        self.layer_copies = LayerCopies(out_in) if self.unrolled else None
        self.pools: list | None = None
        self.firsts = FirstTokens(self.slots + 2, source.model.config.hidden_size, runtime.mesh)
        self.sent: dict[str, tuple[np.ndarray, Any]] = {}  # `_put`: per input, the last host value and its device copy
        self.sequences: dict[str, list[int]] = {}  # stop string -> its device sequence ([]: host check only)

    def reset(self) -> None:
        """Forget the pools and the first-token buffer (remade at the next call: a failed call may have consumed
        them), what was sent, and every first-token row."""
        self.pools = None
        self.firsts.reset()
        self.sent.clear()

    def slot_count(self, live: int) -> int:
        """The decode slots of a call with `live` rows (`slot_count`)."""
        return slot_count(live, self.slots, self.fsdp, self.slot_steps)

    def _pools(self) -> list:
        if self.pools is None:
            self.pools, made, released = make_pools(self.source.model, self.runtime.mesh, self.num_pages, self.page)
            logger.info("paged KV pools: %d pages, %.2f GiB%s", self.num_pages, made / 2**30,
                        f"; {released / 2**30:.2f} GiB of it resident only once written (its zero pages handed "
                        "back to the system)" if released else "")
        return self.pools

    def kv_blocks(self, last_pos: int) -> int | None:
        """The static block count of a decode call whose furthest input sits at `last_pos` (`block_bucket`),
        or None where the device finds it. (Prefill calls always let the device find it: a few host round
        trips per call are nothing next to a chunk's work, and its programs stay few.)"""
        return block_bucket(last_pos, self.kv_block, self.max_blocks) if self.bucketed else None

    def _call(self, key: tuple, fn, *args, donate: tuple[str, ...] = ("pools",), **static) -> Any:
        """Program `fn` of `key` (named `key[0]`), its `donate` arguments donated."""
        compiled = self.runtime.jit(key, fn, tuple(static), donate=donate)
        return self.runtime.run(key[0], compiled, *args, **static)

    def prefill(self, groups: list[Group]) -> None:
        """One call writing up to `prefill_rows` chunks of the groups' prompts (in order) into their pages
        (as many rows as they need, in powers of 2); advances each group's `prefilled`."""
        c = self.chunk
        wanted = sum((g.prefix - 1) // c - g.prefilled // c + 1 for g in groups if g.prefilled < g.prefix)
        r = prefill_row_count(wanted, self.chunk_rows, self.fsdp)
        segments = []  # per row: (group, first position, end)
        for g in groups:
            while len(segments) < r and g.prefilled < g.prefix:
                start = g.prefilled - g.prefilled % c  # chunks at fixed absolute positions
                end = min(start + c, g.prefix)
                segments.append((g, g.prefilled, end))
                g.prefilled = end
        c = prefill_width(max(end - first for _, first, end in segments), r, c)
        arrays = {"ids_rc": np.zeros((r, c), np.int32), "pos_rc": np.zeros((r, c), np.int32),
                  "valid_rc": np.zeros((r, c), bool), "adapter_r": np.zeros(r, np.int32),
                  "table_rw": np.zeros((r, self.width), np.int32),
                  "first_r": np.full(r, self.firsts.size, np.int32)}
        for i, (g, first, end) in enumerate(segments):
            n = end - first
            arrays["ids_rc"][i, :n] = g.prompt[first:end]
            arrays["pos_rc"][i, :n] = np.arange(first, end)
            arrays["valid_rc"][i, :n] = True
            arrays["adapter_r"][i] = g.adapter
            arrays["table_rw"][i, : len(g.pages)] = g.pages
            if end == g.prefix:  # its prompt's last token: its hidden state gives the rows' first tokens
                arrays["first_r"][i] = g.first
            self.stats["prefill_tokens"] += n
        inp = PrefillInputs(**self.runtime.put_batch(arrays))
        model = self.source.model
        # (r, c) decides: one program each
        layer_defs, copies = (None, None) if self.layer_copies is None else self.layer_copies.get(model, head=False)
        self.pools, self.firsts.array = self._call(("sample_prefill", r, c), prefill_chunk, model, self._pools(),
                                                   self.firsts.get(), inp, copies and copies.stacks,
                                                   impl=self.impl, kv_block=self.prefill_block, layer_defs=layer_defs,
                                                   donate=("pools", "firsts_nd"))

    def decode(self, live: list[Live], bound: int, after: DecodeCall | None = None) -> DecodeCall:
        """Dispatch one call of up to `bound` steps (<= `max_decode_steps_per_call`: a traced value, one program)
        for the live rows, without waiting for it (`read` returns its results). `after`: a call over the same
        rows, dispatched and not yet read: this one starts from that call's end state on the device (each slot's
        token, position, stops; a slot whose row the host has ended since, `alive` False, runs inactive), so
        the host sends only the page tables, grown beforehand for both calls."""
        if after is None:
            s = self.slot_count(len(live))
            topk = self.topk_width if any(lv.row.spec.options.topk_sample_logprobs for lv in live) else 0
            stop_width = max(8, pow2(max(len(lv.row.spec.stop_tokens) for lv in live)))
            # the repetition penalty's token sets, sent only when a row uses one (a program of its own)
            penalized = any(lv.row.spec.repetition_penalty != 1.0 for lv in live)
            arrays = self._slot_arrays(live, s, stop_width, penalized)
            sequences = self._stop_sequence_arrays(live, s)  # likewise, stop strings on the device
            # the penalty's token sets change every call (and are large): sent as they are
            presence = {"presence_sv": arrays.pop("presence_sv", None)}
            inp = SlotInputs(**(self._put(arrays | sequences) | (self.runtime.put_batch(presence)
                                                                 if penalized else presence)),
                             prefix=self._prefix(live, s))
            seq_shape = sequences["stop_seq_sxl"].shape[1:] if sequences else None
            ahead, key = 0, ("sample_decode", s, self.steps, stop_width, topk, penalized, seq_shape)
        else:
            inp, ahead, key = self._continued(live, after), after.bound, after.key[:-1]
        # the furthest position a running row's input reaches in this call (a row stops at its last)
        blocks = self.kv_blocks(max(min(lv.pos + ahead + bound - 1, lv.last) for lv in live if lv.alive))
        key += (blocks,)
        model = self.source.model
        # None: the program scans the stacks
        # the head's copy is read by programs of 2+ rows only (tx/sampling/layer_copies.py)
        layer_defs, copies = self.layer_copies.get(model, head=key[1] > 1) if self.layer_copies else (None, None)
        self.pools, out = self._call(key, decode_steps, model, self._pools(), self.firsts.get(), inp, np.int32(bound),
                                     copies, steps=self.steps, topk=key[4], impl=self.impl, kv_block=self.kv_block,
                                     kv_blocks=blocks, layer_defs=layer_defs)
        self.stats["calls"] += 1
        return DecodeCall(list(live), bound, inp, out, key)

    def _prefix(self, live: list[Live], s: int) -> SharedPrefix | None:
        """The shared pages of a call's rows (tx/sampling/prefix_segments.py), in programs of 2+ slots."""
        if not self.shared_prefix or s < 2:
            return None
        plan = plan_segments([lv.table if lv.alive else None for lv in live], [lv.pos for lv in live], s,
                             self.fsdp, self.width, self.page, self.kv_block)
        self.stats["shared_prefix_rows"] += int(np.count_nonzero(plan["len_s"]))  # rows reading shared pages
        return SharedPrefix(**{k[7:]: x for k, x in self._put({f"prefix_{k}": x for k, x in plan.items()}).items()})

    def _continued(self, live: list[Live], after: DecodeCall) -> SlotInputs:
        """The inputs of a call continuing `after` on the device: its end state, the rows' grown tables."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding

        from tx.models.sharding import batch_spec

        s = after.slots
        table_sw = np.zeros((s, self.width), np.int32)
        for j, lv in enumerate(live):
            table_sw[j, : len(lv.table)] = lv.table
        zeros = np.zeros(s, np.int32)
        sent = self._put({"table_sw": table_sw, "copy_src_s": zeros, "copy_dst_s": zeros,
                          "first_s": np.full(s, -1, np.int32)})

        def laid_out(x):  # the program's outputs as `put_batch` lays inputs out: the same program runs
            return None if x is None else jax.device_put(x, NamedSharding(self.runtime.mesh, batch_spec(x.ndim)))

        carry = after.out.carry
        active_s = laid_out(carry.active_s)
        alive_s = np.zeros(s, bool)
        alive_s[: len(live)] = [lv.alive for lv in live]
        if not alive_s[: len(live)].all():  # rows the host ended on a stop string run on no further
            active_s = jnp.logical_and(active_s, self._put({"alive_s": alive_s})["alive_s"])
        return after.inp._replace(token_s=laid_out(carry.token_s), pos_s=laid_out(carry.pos_s),
                                  gen_s=laid_out(carry.gen_s), active_s=active_s,
                                  presence_sv=laid_out(carry.presence_sv), recent_sl=laid_out(carry.recent_sl),
                                  **sent)

    def _put(self, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """`arrays` on the device: each sent again only where it differs from the last one of its name (while
        the same rows decode, their sampling parameters, stop lists and most tables stay as they are)."""
        fresh = {k: v for k, v in arrays.items()
                 if k not in self.sent or self.sent[k][0].shape != v.shape or not np.array_equal(self.sent[k][0], v)}
        for k, x in self.runtime.put_batch(fresh).items():
            self.sent[k] = (fresh[k], x)
        return {k: self.sent[k][1] for k in arrays}

    def read(self, call: DecodeCall) -> list[tuple[Live, bool, int]]:
        """Wait for `call`; append what each of its rows still `alive` sampled to its result and advance its
        position. Those rows, each with whether it ended and how many tokens it had before. (A row the host
        ended after the call was dispatched, on a stop string only it saw, ran on in it: what it sampled there
        is dropped.)"""
        from tx.models.sharding import to_host

        out = call.out
        tokens_sk, logprobs_sk, new_s, done_s, hit_s = (to_host(x) for x in out[:5])
        self.stats["decode_forwards"] += int(to_host(out.forwards))
        top_ids, top_lps = (None if x is None else to_host(x) for x in (out.top_ids_skq, out.top_logprobs_skq))
        rows = []
        for j, lv in enumerate(call.live):
            n = int(new_s[j])
            if not lv.alive:
                self.stats["decode_tokens_dropped"] += n
                continue
            res, q = lv.row.result, lv.row.spec.options.topk_sample_logprobs
            start = len(res.tokens)
            res.tokens += tokens_sk[j, :n].tolist()
            res.logprobs += logprobs_sk[j, :n].tolist()
            if top_ids is not None:
                res.top_ids += top_ids[j, :n, :q].tolist()
                res.top_logprobs += top_lps[j, :n, :q].tolist()
            self.stats["decode_tokens"] += n
            lv.pos += n
            if n:
                lv.token = res.tokens[-1]
            res.stopped = bool(hit_s[j])
            rows.append((lv, bool(done_s[j]), start))
        return rows

    def stop_sequences(self, stops: list[str]) -> list[list[int]]:
        """The stop strings' token sequences the device watches for: each string as the tokenizer writes it,
        kept only where those tokens' text contains the string (so a device stop is always a stop the host
        finds); the host still checks every call's text (`PagedEngine._hit_stop_string`), which also
        catches a stop the model writes with other tokens."""
        out = []
        if len(self.sequences) > 4096:  # tenants choose the strings: a bounded cache
            self.sequences.clear()
        for stop in stops:
            if stop not in self.sequences:
                seq = self.text.encode_text(stop)
                self.sequences[stop] = seq if seq and stop in self.text.decode_text(seq) else []
            if self.sequences[stop]:
                out.append(self.sequences[stop])
        return out

    def _stop_sequence_arrays(self, live: list[Live], s: int) -> dict[str, np.ndarray]:
        """`stop_seq_sxl` and `recent_sl` (paged_step.SlotInputs) when a row has a stop sequence, else none:
        x and l in powers of two (few programs)."""
        per_row = [self.stop_sequences(lv.row.spec.stop_strings) for lv in live]
        if not any(per_row):
            return {}
        x = pow2(max(len(seqs) for seqs in per_row))
        width = pow2(max(len(seq) for seqs in per_row for seq in seqs))
        seq_sxl = np.full((s, x, width), -1, np.int32)
        recent_sl = np.full((s, width), -1, np.int32)
        for j, (lv, seqs) in enumerate(zip(live, per_row)):
            for i, seq in enumerate(seqs):
                seq_sxl[j, i, width - len(seq):] = seq
            tail = lv.row.result.tokens[-width:]
            if tail:
                recent_sl[j, width - len(tail):] = tail
        return {"stop_seq_sxl": seq_sxl, "recent_sl": recent_sl}

    def _slot_arrays(self, live: list[Live], s: int, stop_width: int, penalized: bool) -> dict[str, np.ndarray]:
        arrays = {"token_s": np.zeros(s, np.int32), "pos_s": np.zeros(s, np.int32), "gen_s": np.zeros(s, np.int32),
                  "active_s": np.zeros(s, bool), "adapter_s": np.zeros(s, np.int32), "seed_s": np.zeros(s, np.uint32),
                  "temperature_s": np.zeros(s, np.float32), "top_k_s": np.zeros(s, np.int32),
                  "top_p_s": np.ones(s, np.float32), "max_tokens_s": np.zeros(s, np.int32),
                  "stop_sx": np.full((s, stop_width), -1, np.int32), "table_sw": np.zeros((s, self.width), np.int32),
                  "copy_src_s": np.zeros(s, np.int32), "copy_dst_s": np.zeros(s, np.int32),
                  "min_p_s": np.zeros(s, np.float32), "penalty_s": np.ones(s, np.float32),
                  "first_s": np.full(s, -1, np.int32)}
        if penalized:
            arrays["presence_sv"] = np.zeros((s, self.source.model.config.vocab_size), bool)
        for j, lv in enumerate(live):
            row = lv.row.spec
            arrays["token_s"][j], arrays["pos_s"][j], arrays["gen_s"][j] = lv.token, lv.pos, len(lv.row.result.tokens)
            arrays["active_s"][j], arrays["adapter_s"][j], arrays["seed_s"][j] = True, row.adapter, row.seed
            arrays["temperature_s"][j], arrays["top_k_s"][j], arrays["top_p_s"][j] = row.temperature, row.top_k, row.top_p
            arrays["max_tokens_s"][j] = row.max_tokens
            arrays["stop_sx"][j, : len(row.stop_tokens)] = row.stop_tokens
            arrays["table_sw"][j, : len(lv.table)] = lv.table
            arrays["min_p_s"][j], arrays["penalty_s"][j] = row.min_p, row.repetition_penalty
            if penalized and row.repetition_penalty != 1.0:
                arrays["presence_sv"][j, row.prompt] = True
                arrays["presence_sv"][j, lv.row.result.tokens] = True
            if lv.copy is not None:  # made by this call, before any slot reads its pages
                arrays["copy_src_s"][j], arrays["copy_dst_s"][j] = lv.copy
                lv.copy = None
            arrays["first_s"][j], lv.first = lv.first, -1  # its first token, chosen by this call's first step
        return arrays
