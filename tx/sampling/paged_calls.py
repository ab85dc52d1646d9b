"""The paged engine's device side: the KV page pools, and packing the host's rows into the fixed-shape
inputs of `prefill_chunk` and `decode_steps` (tx/sampling/paged_step.py), then the outputs back into rows.

`tx/sampling/continuous.py` decides which prompts and rows run (pages, slots, preemption); this module
only turns its `_Group`s (prompts being prefilled) and `_Live` rows (decode slots) into arrays. Few shapes,
so few programs: prefill rows go in powers of 4 up to `prefill_rows`, decode slots in powers of 2 up to
`max_num_seqs` (both rounded up to the fsdp size: rows are split over its devices), stop lists in powers of
2 >= 8, and top-k has one width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tx.sampling.paged_step import PrefillInputs, SlotInputs, decode_steps, prefill_chunk

if TYPE_CHECKING:
    from tx.backends.sampler import Sampler
    from tx.sampling.continuous import _Group, _Live


def pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def slot_count(live: int, max_num_seqs: int, fsdp: int) -> int:
    """Decode slots of a call with `live` rows: a power of two (at most `max_num_seqs`), rounded up to the
    fsdp size."""
    s = min(pow2(live), max_num_seqs)
    return -(-s // fsdp) * fsdp


def pow4(n: int) -> int:
    p = 1
    while p < n:
        p *= 4
    return p


class PagedDevice:
    """Page pools `[layers, pages, page, kv_heads, head_dim]` per layer stack (created at first use,
    donated to every call) and the two device calls over them."""

    def __init__(self, sampler: Sampler, num_pages: int, width: int, stats: dict[str, int]):
        self.sampler, self.backend = sampler, sampler.backend
        cfg = self.backend.config
        self.num_pages, self.page, self.width = num_pages, cfg.kv_page_size, width
        self.slots, self.fsdp = cfg.max_num_seqs, self.backend.mesh.shape["fsdp"]
        self.chunk, self.chunk_rows = cfg.prefill_chunk, cfg.prefill_rows
        self.steps = max(cfg.decode_steps_per_call, cfg.max_decode_steps_per_call)  # the buffers' width
        self.impl, self.kv_block = cfg.paged_attention_impl, cfg.kv_block
        self.topk_width = pow2(cfg.max_topk_prompt_logprobs)  # topk_sample_logprobs are bounded by it
        self.stats = stats
        self.pools: list | None = None

    def _pools(self) -> list:
        if self.pools is None:
            import jax.numpy as jnp
            from jax.sharding import NamedSharding

            from tx.models.sharding import put_global

            model = self.backend.model
            cfg, dtype = model.config, model.embed_tokens.embedding[...].dtype
            shape = lambda n: (n, self.num_pages, self.page, cfg.num_key_value_heads, cfg.head_dim)  # noqa: E731
            # kv heads split like the attention's keys/values (tp); every page on every fsdp device
            axes = ("layers", None, None, "kv_heads", "head_dim")
            layout = lambda n: NamedSharding(self.backend.mesh, model.layout.spec(axes, shape(n)))  # noqa: E731
            self.pools = [tuple(put_global(np.zeros(shape(len(s.layer_ids)), jnp.dtype(dtype)), layout(len(s.layer_ids)))
                                for _ in range(2)) for s in model.stacks]
        return self.pools

    def _call(self, name: str, key: tuple, fn, *args, **static) -> Any:
        import jax

        sampler = self.sampler
        compiled = self.backend._fn(key, lambda: jax.jit(sampler._counting(name, fn), static_argnames=tuple(static),
                                                         donate_argnames=("pools",)))
        return self.backend._run(name, compiled, *args, **static)

    def prefill(self, groups: list[_Group]) -> None:
        """One call writing up to `prefill_rows` chunks of the groups' prompts (in order) into their pages
        (as many rows as they need, in powers of 4); advances each group's `prefilled`."""
        c = self.chunk
        wanted = sum((g.prefix - 1) // c - g.prefilled // c + 1 for g in groups if g.prefilled < g.prefix)
        r = min(pow4(wanted), self.chunk_rows)  # rows in powers of 4: few programs, little padding
        r = -(-r // self.fsdp) * self.fsdp
        arrays = {"ids_rc": np.zeros((r, c), np.int32), "pos_rc": np.zeros((r, c), np.int32),
                  "valid_rc": np.zeros((r, c), bool), "adapter_r": np.zeros(r, np.int32),
                  "table_rw": np.zeros((r, self.width), np.int32)}
        used = 0
        for g in groups:
            while used < r and g.prefilled < g.prefix:
                start = g.prefilled - g.prefilled % c  # chunks at fixed absolute positions
                end = min(start + c, g.prefix)
                n = end - g.prefilled
                arrays["ids_rc"][used, :n] = g.prompt[g.prefilled:end]
                arrays["pos_rc"][used, :n] = np.arange(g.prefilled, end)
                arrays["valid_rc"][used, :n] = True
                arrays["adapter_r"][used] = g.adapter
                arrays["table_rw"][used, : len(g.pages)] = g.pages
                self.stats["prefill_tokens"] += n
                g.prefilled = end
                used += 1
        inp = PrefillInputs(**self.sampler._put(arrays))
        self.pools = self._call("sample_prefill", ("sample_prefill", r, c), prefill_chunk, self.backend.model,
                                self._pools(), inp, impl=self.impl, kv_block=self.kv_block)

    def decode(self, live: list[_Live], bound: int) -> list[bool]:
        """One call of up to `bound` steps (<= `max_decode_steps_per_call`: a traced value, one program) for
        the live rows; appends what each sampled to its result and advances its position. Whether each row
        ended."""
        s = slot_count(len(live), self.slots, self.fsdp)
        topk = self.topk_width if any(lv.row.spec.options.topk_sample_logprobs for lv in live) else 0
        stop_width = max(8, pow2(max(len(lv.row.spec.stop_tokens) for lv in live)))
        # the repetition penalty's token sets, sent only when a row uses one (a program of its own)
        penalized = any(lv.row.spec.repetition_penalty != 1.0 for lv in live)
        inp = SlotInputs(**({"presence_sv": None} | self.sampler._put(self._slot_arrays(live, s, stop_width,
                                                                                         penalized))))
        key = ("sample_decode", s, self.steps, stop_width, topk, penalized)
        self.pools, out = self._call("sample_decode", key, decode_steps, self.backend.model, self._pools(), inp,
                                     np.int32(bound), steps=self.steps, topk=topk, impl=self.impl,
                                     kv_block=self.kv_block)
        from tx.models.sharding import to_host

        tokens_sk, logprobs_sk, new_s, done_s, hit_s, top_ids, top_lps = [None if x is None else to_host(x)
                                                                          for x in out]
        self.stats["calls"] += 1
        finished = []
        for j, lv in enumerate(live):
            n, res, q = int(new_s[j]), lv.row.result, lv.row.spec.options.topk_sample_logprobs
            res.tokens += tokens_sk[j, :n].tolist()
            res.logprobs += logprobs_sk[j, :n].tolist()
            if topk:
                res.top_ids += top_ids[j, :n, :q].tolist()
                res.top_logprobs += top_lps[j, :n, :q].tolist()
            self.stats["decode_tokens"] += n
            lv.pos += n
            if n:
                lv.token = res.tokens[-1]
            res.stopped = bool(hit_s[j])
            finished.append(bool(done_s[j]))
        return finished

    def _slot_arrays(self, live: list[_Live], s: int, stop_width: int, penalized: bool) -> dict[str, np.ndarray]:
        arrays = {"token_s": np.zeros(s, np.int32), "pos_s": np.zeros(s, np.int32), "gen_s": np.zeros(s, np.int32),
                  "active_s": np.zeros(s, bool), "adapter_s": np.zeros(s, np.int32), "seed_s": np.zeros(s, np.uint32),
                  "temperature_s": np.zeros(s, np.float32), "top_k_s": np.zeros(s, np.int32),
                  "top_p_s": np.ones(s, np.float32), "max_tokens_s": np.zeros(s, np.int32),
                  "stop_sx": np.full((s, stop_width), -1, np.int32), "table_sw": np.zeros((s, self.width), np.int32),
                  "copy_src_s": np.zeros(s, np.int32), "copy_dst_s": np.zeros(s, np.int32),
                  "min_p_s": np.zeros(s, np.float32), "penalty_s": np.ones(s, np.float32)}
        if penalized:
            arrays["presence_sv"] = np.zeros((s, self.backend.model.config.vocab_size), bool)
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
        return arrays
