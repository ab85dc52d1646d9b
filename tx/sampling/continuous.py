"""The paged sampling engine's host side: page tables, prompt sharing, continuous batching.

`PagedEngine.run(rows)` samples validated rows (`tx.sampling.requests.SampleRow`) and returns one
`RowResult` per row. How:
- **Prompt sharing.** The rows of one request share its prompt. The prompt is prefilled once, up to but
  not including its last token, into pages the request's rows all read; each row copies the partial last
  page (copy-on-write), feeds the prompt's last token itself and decodes into its own pages. KV memory held
  is the shared prompt once plus each row's own tokens.
- **Continuous batching.** A fixed number of decode slots (`max_num_seqs`). Every iteration runs at most
  one prefill call (`prefill_rows` chunks of `prefill_chunk` tokens at fixed absolute positions, so a long
  prompt never stalls the decoding rows for more than one chunk) and one decode call of up to
  `decode_steps_per_call` steps over the live rows. A row leaves its slot the call it stops, its pages are
  freed, and the next waiting row takes the slot.
- **Pages.** A row is admitted with every page it can need (prompt remainder + `max_tokens`), so a running
  row never runs out of pages; rows wait, never fail, when the pool is full. Requests are admitted in order:
  a new prompt is prefilled only once every earlier request's rows hold a slot, which guarantees progress
  (the pool holds at least one longest row beside one longest prompt).
- **Determinism.** Decisions depend only on the rows and the configuration (no clocks, no `hash()`), so
  every host of a multi-host run makes the same ones. A row's tokens depend only on its seed and its own
  position in the generated sequence: alone, in a full batch, or joining later, it samples the same tokens
  (up to float32 summation differences between batch shapes, as the static engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tx.sampling.decode import DecodeOutputs
from tx.sampling.kv_pages import PageTable
from tx.sampling.paged_step import PrefillInputs, SlotInputs, copy_pages, decode_steps, prefill_chunk
from tx.sampling.requests import SampleRow

if TYPE_CHECKING:
    from tx.backends.sampler import Sampler


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


@dataclass
class RowResult:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # ended on a stop token (else max_tokens)
    cached_prompt_tokens: int = 0  # of its request's prompt, read from the prefix cache
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


    def as_outputs(self, topk: int) -> DecodeOutputs:
        """This row as row 0 of a static decode's outputs (for `outputs.sequence_of`)."""
        n = len(self.tokens)
        top = (None, None)
        if topk:
            top = (np.asarray(self.top_ids, np.int32).reshape(1, n, topk),
                   np.asarray(self.top_logprobs, np.float32).reshape(1, n, topk))
        return DecodeOutputs(np.asarray([self.tokens], np.int32).reshape(1, n),
                             np.asarray([self.logprobs], np.float32).reshape(1, n), np.asarray([n]),
                             np.asarray([self.stopped]), *top)


@dataclass
class _Group:
    """One request's rows and its shared prompt pages (positions 0 .. n-2)."""

    rows: list[int]
    prompt: np.ndarray
    adapter: int
    identity: str | None = None  # the weights its KV is computed with (prefix-cache key); None: not shared
    pages: list[int] = field(default_factory=list)
    prefilled: int = 0
    cached: int = 0  # prompt tokens read from the prefix cache
    admitted: int = 0  # rows given a slot so far
    live: int = 0  # rows admitted and not finished

    @property
    def prefix(self) -> int:
        return len(self.prompt) - 1

    @property
    def ready(self) -> bool:
        return self.prefilled >= self.prefix


@dataclass
class _Live:
    row: int
    group: _Group
    table: list[int]
    own: list[int]  # pages only this row holds
    pos: int
    token: int
    gen: int = 0
    result: RowResult = field(default_factory=lambda: RowResult([], [], False))


class PagedEngine:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.backend = sampler.backend
        cfg = self.backend.config
        self.page = cfg.kv_page_size
        self.width = -(-self.backend.max_seq_len // self.page) + 1
        self.num_pages = cfg.kv_cache_pages or (cfg.max_num_seqs * self.width // 4 + 2 * self.width + 1)
        if self.num_pages < 2 * self.width + 1:
            raise ValueError(f"kv_cache_pages={self.num_pages} is below {2 * self.width + 1}: the pool must hold one "
                             f"longest prompt and one longest row (max_seq_len={self.backend.max_seq_len}, "
                             f"kv_page_size={self.page})")
        self.slots = cfg.max_num_seqs
        self.chunk, self.chunk_rows = cfg.prefill_chunk, cfg.prefill_rows
        self.steps = cfg.decode_steps_per_call
        self.impl, self.kv_block = cfg.paged_attention_impl, cfg.kv_block
        self.pools: list | None = None
        self.pages = PageTable(self.num_pages, self.page)  # kept across calls: the prefix cache lives in it
        self.prefix_cache = cfg.prefix_cache
        self.stats = self.backend.metrics.sampling  # reported by /api/v1/metrics
        self.stats.update({"prefill_tokens": 0, "prefill_tokens_cached": 0, "decode_tokens": 0, "peak_pages": 0,
                           "calls": 0, "kv_cache_pages": self.num_pages})

    # ---- device state and programs ----

    def _pools(self) -> list:
        if self.pools is None:
            import jax.numpy as jnp
            from jax.sharding import NamedSharding, PartitionSpec as P

            from tx.models.sharding import put_global

            model = self.backend.model
            cfg, dtype = model.config, model.embed_tokens.embedding[...].dtype
            replicated = NamedSharding(self.backend.mesh, P())
            shape = lambda n: (n, self.num_pages, self.page, cfg.num_key_value_heads, cfg.head_dim)  # noqa: E731
            self.pools = [tuple(put_global(np.zeros(shape(len(s.layer_ids)), jnp.dtype(dtype)), replicated)
                                for _ in range(2)) for s in model.stacks]
        return self.pools

    def _call(self, name: str, key: tuple, fn, *args, **static) -> Any:
        from flax import nnx

        sampler = self.sampler
        compiled = self.backend._fn(key, lambda: nnx.jit(sampler._counting(name, fn), static_argnames=tuple(static),
                                                         donate_argnames=("pools",)))
        return self.backend._run(name, compiled, *args, **static)

    # ---- the loop ----

    def run(self, rows: list[SampleRow]) -> list[RowResult]:
        try:
            return self._run(rows)
        except BaseException:
            # pages held by the failed call's rows and (donated) pools are in an unknown state: start over
            self.pages, self.pools = PageTable(self.num_pages, self.page), None
            raise

    def _run(self, rows: list[SampleRow]) -> list[RowResult]:
        results: list[RowResult | None] = [None] * len(rows)
        groups: dict[int, _Group] = {}
        for i, row in enumerate(rows):
            if row.max_tokens <= 0:
                results[i] = RowResult([], [], False)
                continue
            g = groups.setdefault(row.request_index,
                                  _Group([], row.prompt, row.adapter, self.backend.kv_identity(row.adapter)))
            g.rows.append(i)
        waiting = list(groups.values())
        prefilling: list[_Group] = []  # admitted, prompt not fully written
        ready: list[_Group] = []  # prompt written, rows waiting for a slot
        live: list[_Live] = []
        pages = self.pages
        topk = max((r.options.topk_sample_logprobs for r in rows), default=0)
        topk = _pow2(topk) if topk else 0
        stop_width = max(4, _pow2(max((len(r.stop_tokens) for r in rows), default=1)))
        while waiting or prefilling or ready or live:
            # admit the next request once every earlier one's rows hold a slot
            if waiting and not prefilling and not ready:
                g = waiting[0]
                total = -(-g.prefix // self.page)
                hits = pages.lookup(g.identity, g.prompt[: g.prefix]) if self._caching(g.identity) else []
                need = total - len(hits)
                if pages.available >= need + self._row_pages(g, rows[g.rows[0]]):
                    g.pages = hits + (pages.allocate(need) if need else [])
                    g.prefilled = g.cached = len(hits) * self.page
                    self.stats["prefill_tokens_cached"] += g.prefilled
                    (prefilling if not g.ready else ready).append(waiting.pop(0))
                    if g.ready:
                        self._publish(g.identity, g.prompt[: g.prefix], g.pages)
                else:
                    pages.release(hits)
            copies: list[tuple[int, int]] = []
            while ready and len(live) < self.slots:
                g = ready[0]
                row = rows[g.rows[g.admitted]]
                own = pages.allocate(self._row_pages(g, row))
                if own is None:
                    break
                first = g.prefix // self.page
                if g.prefix % self.page:  # the shared partial page: this row writes its own copy
                    copies.append((g.pages[first], own[0]))
                live.append(_Live(g.rows[g.admitted], g, g.pages[:first] + own, own, g.prefix, int(g.prompt[-1])))
                g.admitted += 1
                g.live += 1
                if g.admitted == len(g.rows):
                    ready.pop(0)
            self.stats["peak_pages"] = max(self.stats["peak_pages"], pages.in_use)
            if copies:
                self._copy(copies)
            if prefilling:
                self._prefill(prefilling)
                for g in [g for g in prefilling if g.ready]:
                    prefilling.remove(g)
                    ready.append(g)
                    self._publish(g.identity, g.prompt[: g.prefix], g.pages)
            if live:
                for lv, done in zip(live, self._decode(live, rows, topk, stop_width)):
                    if done:
                        results[lv.row] = lv.result
                        lv.result.cached_prompt_tokens = lv.group.cached
                        # its written tokens (prompt, then every sampled token but the last) stay reusable
                        written = np.concatenate([lv.group.prompt, np.asarray(lv.result.tokens[:-1], np.int32)])
                        self._publish(lv.group.identity, written, lv.table)
                        pages.release(lv.own)
                        lv.group.live -= 1
                        if lv.group.live == 0 and lv.group.admitted == len(lv.group.rows) and lv.group.pages:
                            pages.release(lv.group.pages)
                live = [lv for lv in live if results[lv.row] is None]
        return results  # type: ignore[return-value]

    def _caching(self, identity: str | None) -> bool:
        return self.prefix_cache and identity is not None

    def _publish(self, identity: str | None, tokens: np.ndarray, table: list[int]) -> None:
        if self._caching(identity):
            self.pages.publish(identity, tokens.tolist(), table)

    def _row_pages(self, g: _Group, row: SampleRow) -> int:
        """Pages of a row's own positions, from the prompt's last (partial) page to its last written token."""
        return (g.prefix + row.max_tokens - 1) // self.page - g.prefix // self.page + 1

    # ---- calls ----

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        m = _pow2(len(pairs))
        src, dst = np.zeros(m, np.int32), np.zeros(m, np.int32)
        src[: len(pairs)], dst[: len(pairs)] = zip(*pairs)
        arrays = self.sampler._put({"src": src, "dst": dst})
        self.pools = self._call("sample_copy_pages", ("sample_copy_pages", m), copy_pages, self._pools(),
                                arrays["src"], arrays["dst"])

    def _prefill(self, groups: list[_Group]) -> None:
        r, c = self.chunk_rows, self.chunk
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

    def _decode(self, live: list[_Live], rows: list[SampleRow], topk: int, stop_width: int) -> list[bool]:
        s = _pow2(len(live))
        arrays = {"token_s": np.zeros(s, np.int32), "pos_s": np.zeros(s, np.int32), "gen_s": np.zeros(s, np.int32),
                  "active_s": np.zeros(s, bool), "adapter_s": np.zeros(s, np.int32), "seed_s": np.zeros(s, np.uint32),
                  "temperature_s": np.zeros(s, np.float32), "top_k_s": np.zeros(s, np.int32),
                  "top_p_s": np.ones(s, np.float32), "max_tokens_s": np.zeros(s, np.int32),
                  "stop_sx": np.full((s, stop_width), -1, np.int32), "table_sw": np.zeros((s, self.width), np.int32)}
        for j, lv in enumerate(live):
            row = rows[lv.row]
            arrays["token_s"][j], arrays["pos_s"][j], arrays["gen_s"][j] = lv.token, lv.pos, lv.gen
            arrays["active_s"][j], arrays["adapter_s"][j], arrays["seed_s"][j] = True, row.adapter, row.seed
            arrays["temperature_s"][j], arrays["top_k_s"][j], arrays["top_p_s"][j] = row.temperature, row.top_k, row.top_p
            arrays["max_tokens_s"][j] = row.max_tokens
            arrays["stop_sx"][j, : len(row.stop_tokens)] = row.stop_tokens
            arrays["table_sw"][j, : len(lv.table)] = lv.table
        inp = SlotInputs(**self.sampler._put(arrays))
        self.pools, out = self._call("sample_decode", ("sample_decode", s, self.steps, stop_width, topk), decode_steps,
                                     self.backend.model, self._pools(), inp, steps=self.steps, topk=topk,
                                     impl=self.impl, kv_block=self.kv_block)
        from tx.models.sharding import to_host

        out = [None if x is None else to_host(x) for x in out]
        tokens_sk, logprobs_sk, new_s, done_s, hit_s, top_ids, top_lps = out
        self.stats["calls"] += 1
        finished = []
        for j, lv in enumerate(live):
            n = int(new_s[j])
            res = lv.result
            res.tokens += tokens_sk[j, :n].tolist()
            res.logprobs += logprobs_sk[j, :n].tolist()
            if topk:
                res.top_ids += top_ids[j, :n].tolist()
                res.top_logprobs += top_lps[j, :n].tolist()
            self.stats["decode_tokens"] += n
            lv.gen += n
            lv.pos += n
            if n:
                lv.token = res.tokens[-1]
            res.stopped = bool(hit_s[j])
            finished.append(bool(done_s[j]))
        return finished
