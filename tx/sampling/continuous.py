"""The paged sampling engine's host side: prompt sharing, continuous batching, preemption.

`PagedEngine` keeps sampling rows (`tx.sampling.requests.SampleRow`) across calls: `add` queues a call's
rows, each `step` runs one iteration and returns the rows that finished in it, so rows join and leave
between device calls (`tx.sampling.paged_calls` packs them into the device calls). It decides which rows
run; whether they fit and which pages they get, `tx.sampling.kv_cache.KVCacheManager` (`self.kv`) says. How:
- **Prompt sharing.** The rows of one request share its prompt. The prompt is prefilled once, all of it,
  into pages the request's rows all read; the prefill call that writes its last token keeps that token's
  final hidden state on the device, from which each row's first decode call chooses the row's first token
  (a call whose rows all start so runs no layers in its first step: a prompt's last token goes through the
  model once, in the prefill's matmuls, not once more per row in a decode step). Each row copies the partial
  last page (copy-on-write) and decodes into its own pages. KV memory held is the shared prompt once plus
  each row's own tokens.
- **Continuous batching.** A fixed number of decode slots (`max_num_seqs`). Every iteration runs at most
  one prefill call (`prefill_rows` chunks of `prefill_chunk` tokens at fixed absolute positions, so a long
  prompt never stalls the decoding rows for more than one chunk), gives the rows of the prompts it
  completes free slots at once (their first token comes from the same iteration), and runs one decode call
  over the live rows: of up to `decode_steps_per_call` steps while requests wait to join, else up to
  `max_decode_steps_per_call` (one device loop either way, ending early once every row has stopped, and cut
  where enough rows reach their max_tokens that the rest fit a smaller slot count). A row
  leaves its slot the call it stops, its pages are freed, and the next waiting row takes the slot.
- **Async dispatch** (`paged_async_dispatch`). While no request waits to join (or while every slot holds a
  row that runs on past the current call and a prefilled request waits: the host could do nothing else),
  the next decode call is dispatched from the current one's end state on the device (each slot's token,
  position, stops) before the host reads the current one, so the device does not wait for the host between
  calls; the host then reads the results while it runs. Its pages are grown beforehand for both calls
  (their upper bound). Not where the rows left after the current call fit fewer slots (the next call waits
  and packs them), nor where the pool lacks pages for both calls. A row that ends in a call runs inactive in
  the next one; one the host ends on a stop string the device cannot see runs on in the call already
  dispatched (its tokens there are dropped) and is turned off in the one after. A request that arrives
  waits for the call in flight and the one dispatched behind it, so long calls run half of
  `max_decode_steps_per_call`: its wait stays within one long call's, as without async dispatch.
- **Pages on demand, preemption by recompute.** A row holds pages for the tokens it has written plus the
  next call's. Before a decode call every live row, oldest first, gets the pages that call can write;
  when the pool runs out the youngest rows are preempted: their pages are released (published to the
  prefix cache under a key only they use, so a resumed row usually finds them still there) and the row
  goes back to the front of the queue with prompt + its tokens so far as its new prompt. A resumed row
  samples exactly the tokens it would have (its keys depend only on its seed and token count). The pool
  always holds one longest prompt beside one longest row, so the oldest row always progresses. When no row
  decodes and the next prefilled row's first call does not fit (admitted prompts hold the pages), the
  admitted requests no slot reads yet are released the same way, youngest first, until it does: a request
  alone always fits the pool, so the engine never stalls.
- **Admission.** Preempted rows first (oldest first); then, request by request, the earliest request of
  the tenant whose rows hold the fewest slots and admitted places, so a tenant with many queued requests
  shares the slots with one that sends a few instead of making it wait behind all of them (one tenant
  alone, or in-process use: arrival order). As many per iteration as the free slots can take rows of (so
  a batch of distinct prompts prefills together, up to `prefill_rows` chunks per call), and at least one
  ahead of the slots (so a prompt is ready when a slot frees), each only while the free pages cover it
  and the live rows' next call.
- **Determinism.** Decisions depend only on the rows and the configuration (no clocks, no `hash()`), so
  every host of a multi-host run makes the same ones. A row's tokens depend only on its seed and its own
  position in the generated sequence: alone, in a full batch, joining later or resumed after preemption,
  it samples the same tokens (up to float32 summation differences between batch shapes).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from tx.sampling.kv_cache import KVCacheManager, pool_pages
from tx.sampling.paged_calls import DecodeCall, PagedDevice, free_memory_bytes
from tx.sampling.paged_rows import Group, Live, Row, RowResult
from tx.sampling.requests import SampleRow

if TYPE_CHECKING:
    from collections.abc import Callable

    from tx.runtime import Runtime
    from tx.sampling.source import SamplingSettings, WeightsSource
    from tx.sampling.text import TextCodec


class PagedEngine:
    def __init__(self, source: WeightsSource, runtime: Runtime, config: SamplingSettings, text: TextCodec):
        self.source, self.text = source, text
        cfg = config
        free = free_memory_bytes()
        num_pages = cfg.kv_cache_pages or self._auto_pages(cfg, free)
        self.kv = KVCacheManager(num_pages, cfg.kv_page_size, source.max_seq_len, cfg.prefix_cache)
        self.slots, self.steps = cfg.max_num_seqs, cfg.decode_steps_per_call
        self.async_dispatch = cfg.paged_async_dispatch
        # a call's bound when no request waits. With async dispatch a request that arrives waits for the call
        # in flight and the one dispatched behind it: two calls of half the steps keep that within one call's
        long_steps = max(cfg.decode_steps_per_call, cfg.max_decode_steps_per_call)
        self.max_steps = max(self.steps, long_steps // 2) if self.async_dispatch else long_steps
        self.call_steps = self.steps  # this iteration's decode bound (`_schedule`)
        self.stats = runtime.metrics.sampling  # reported by /api/v1/metrics
        self.stats.update({"prefill_tokens": 0, "prefill_tokens_cached": 0, "decode_tokens": 0, "peak_pages": 0,
                           "pages_in_use": 0, "calls": 0, "chained_calls": 0, "decode_tokens_dropped": 0,
                           "preempted": 0, "shared_prefix_rows": 0, "kv_cache_pages": num_pages,
                           "pages_uncached": 0, "decode_forwards": 0})
        self.device = PagedDevice(source, runtime, config, text, self.kv, self.stats, free)
        self._serial = 0
        self.reset()

    def _auto_pages(self, config: SamplingSettings, free: int) -> int:
        """Every slot at full length plus one longest prompt and row, within half this process's `free`
        device memory (`paged_calls.free_memory_bytes`; `kv_cache.pool_pages`). Hosts differ in memory, so a
        multi-host run takes the smallest pool any process could hold: one pool shape, one SPMD program."""
        from tx.models.sharding import min_over_processes

        token_bytes = self.source.model.kv_bytes_per_token()
        return min_over_processes(pool_pages(config.max_num_seqs, self.source.max_seq_len, config.kv_page_size,
                                             int(free // 2), token_bytes))

    def reset(self) -> None:
        """Forget every row and page (after a failed call the pages and donated pools are in an unknown state)."""
        self.kv.reset()  # only here: the prefix cache lives across calls
        self.published: dict[int, set[str]] = {}  # adapter -> the identities its rows' pages are cached under
        self.device.reset()
        self.inflight: DecodeCall | None = None  # dispatched before the last call was read (`_chain_steps`)
        self.waiting: list[Group] = []  # not admitted, in order (resumed rows first)
        self.prefilling: list[Group] = []  # admitted, prompt not fully written
        self.ready: list[Group] = []  # prompt written, rows waiting for a slot
        self.live: list[Live] = []  # in admission order
        self._done: list[tuple[Any, RowResult]] = []

    # ---- the caller's view ----

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.ready or self.live or self._done)

    def reads(self, slot: int) -> bool:
        """Whether an unfinished row samples from adapter `slot`."""
        return any(g.adapter == slot for g in self.waiting + self.prefilling + self.ready) or \
            any(lv.group.adapter == slot for lv in self.live)

    def slots_read(self) -> set[int]:
        return {g.adapter for g in self.waiting + self.prefilling + self.ready} | {lv.group.adapter for lv in self.live}

    def add(self, rows: list[SampleRow], tags: list[Any]) -> None:
        """Queue rows (those of one `request_index` share a prompt); their results come from `step`."""
        groups: dict[int, Group] = {}
        for row, tag in zip(rows, tags):
            item = Row(row, tag, self._serial)
            self._serial += 1
            if row.max_tokens <= 0:
                self._done.append((tag, item.result))
                continue
            g = groups.get(row.request_index)
            if g is None:
                g = groups[row.request_index] = Group([], row.prompt, row.adapter,
                                                       self.source.kv_identity(row.adapter, row.tenant),
                                                       tenant=row.tenant)
                self.waiting.append(g)
            g.rows.append(item)

    def step(self) -> list[tuple[Any, RowResult]]:
        """One iteration (admissions, at most one prefill call and one decode call); the rows that ended."""
        try:
            self._iterate()
        except BaseException:
            self.reset()
            raise
        done, self._done = self._done, []
        return done

    # ---- one iteration ----

    def _iterate(self) -> None:
        call, self.inflight = self.inflight, None
        if call is not None and not any(lv.alive for lv in call.live):
            self._read(call)  # every row it holds ended since it was dispatched: what it sampled is dropped
            call = None
        if call is None:
            call = self._schedule()
        if call is None:
            return
        steps = self._chain_steps(call)
        if steps is not None:  # dispatched before reading `call`: the device goes on while the host reads
            for lv in self.live:
                if not self.kv.grow(lv, call.bound + steps):
                    raise RuntimeError("pages checked for two calls ran short")
            self._count_pages()
            self.inflight = self.device.decode(call.live, steps, after=call)
            self.stats["chained_calls"] += 1
        self._read(call)
        self._count_pages()

    def _count_pages(self) -> None:
        """The pool's pages in use now (what a metrics scrape reads between iterations) and at most so far."""
        self.stats["pages_in_use"] = self.kv.pages_in_use
        self.stats["peak_pages"] = max(self.stats["peak_pages"], self.kv.pages_in_use)

    def _read(self, call: DecodeCall) -> None:
        for lv, done, start in self.device.read(call):
            if done or self._hit_stop_string(lv, start):
                self._finish(lv)

    def _schedule(self) -> DecodeCall | None:
        """Admissions, at most one prefill call, then the decode call over the live rows (dispatched, not
        read), if any row decodes."""
        self.call_steps = self.steps  # admissions reserve pages for a short call
        self._admit_groups()
        self._admit_rows()
        self._count_pages()
        if self.prefilling:
            self.device.prefill(self.prefilling)
            for g in [g for g in self.prefilling if g.ready]:
                self.prefilling.remove(g)
                self.ready.append(g)
                self._publish(g.adapter, g.identity, g.prompt[: g.prefix], g.pages)
            # rows whose prompt this call finished take free slots now: their first token comes from this
            # iteration's decode call, not one host round trip later
            self._admit_rows()
        self._choose_call_steps()
        if self.live:
            self._grow()
        self._count_pages()
        return self.device.decode(self.live, self.call_steps) if self.live else None

    def _chain_steps(self, call: DecodeCall) -> int | None:
        """The bound of a call over `call`'s slots to dispatch before reading `call` (`paged_async_dispatch`),
        from its end state on the device; None where the next call waits for the host: the pool lacks pages
        for both calls (the next iteration grows or preempts as ever), a prompt is being prefilled, or
        - nothing waits, but the rows left once those reaching their max_tokens in `call` are gone fit fewer
          slots (or none is left);
        - requests wait, and a row could take a slot the next call: one is free, or a row reaches its
          max_tokens in `call`, or no prefilled request waits (the next iteration would prefill one). While
          every slot holds a row that runs on and a prefilled request waits, the host would do nothing but
          this call (short: `decode_steps_per_call`).
        Rows that end on a stop in `call` are known only when it is read: they run inactive in the next."""
        if not self.async_dispatch or self.prefilling:
            return None
        left = [lv.last - lv.pos + 1 - call.bound for lv in call.live if lv.alive]
        if self.waiting or self.ready:
            if len(left) < self.slots or min(left) <= 0 or not self.ready:
                return None
            return self.steps if self.kv.can_grow(self.live, call.bound + self.steps) else None
        left = [n for n in left if n > 0]
        if not left or self.device.slot_count(len(left)) != call.slots:
            return None
        steps = max(self.steps, min(self.max_steps, self._steps_until_fewer_slots(left)))
        return next((b for b in (steps, self.steps) if self.kv.can_grow(self.live, call.bound + b)), None)

    def _hit_stop_string(self, lv: Live, start: int) -> bool:
        """Whether the tokens `lv` sampled from index `start` on complete one of its stop strings: the row then
        ends after this call instead of running to max_tokens (its answer is cut at the stop when assembled,
        `outputs.sequence_of`). The text checked is the new tokens' and enough earlier ones for the longest
        stop (a token is at least one byte; twice that and a few more for a character split over tokens)."""
        stops = lv.row.spec.stop_strings
        if not stops:
            return False
        tokens = lv.row.result.tokens
        back = 2 * max(len(stop.encode()) for stop in stops) + 4
        text = self.text.decode_text(tokens[max(0, start - back):])
        return any(stop in text for stop in stops)

    def _choose_call_steps(self) -> None:
        """This iteration's decode bound: `max_decode_steps_per_call` when no request waits to join and the
        free pages cover the live rows' longer call (fewer returns to the host), else `decode_steps_per_call`
        (a waiting request gets a slot sooner; no row is preempted for the longer call). A longer call also
        ends (at `decode_steps_per_call` at the least) once enough rows will have reached their max_tokens
        that the next call can run on fewer slots: until it returns, every slot costs its compute."""
        if self.waiting or self.prefilling or self.ready:
            return
        left = [lv.last - lv.pos + 1 for lv in self.live]
        self.call_steps = max(self.steps, min(self.max_steps, self._steps_until_fewer_slots(left)))
        if not self.kv.can_grow(self.live, self.call_steps):
            self.call_steps = self.steps

    def _steps_until_fewer_slots(self, left: list[int]) -> int:
        """Decode steps after which so many of the rows that can still take `left` steps each have written
        their last token (their max_tokens; EOS and stops come sooner, unforeseen) that the rest fit the
        next smaller slot count."""
        n = len(left)
        smaller = [c for c in self.device.slot_counts if c < self.device.slot_count(n)] if n else []
        if not smaller:  # cannot shrink: the smallest count (at least the fsdp size)
            return self.max_steps
        return sorted(left)[n - smaller[-1] - 1]

    def _admit_groups(self) -> None:
        """Admit waiting requests (`_next_waiting` first) while the slots can take their rows (the next
        one also when they cannot, once every admitted request's rows hold a slot)."""
        while self.waiting:
            g = self._next_waiting()
            queued = sum(len(q.rows) for q in self.prefilling + self.ready)
            if queued and len(self.live) + queued + len(g.rows) > self.slots:
                return
            if not self._admit_group(g):
                return

    def _next_waiting(self) -> Group:
        """Preempted rows first, oldest first; then the earliest request of the tenant holding the fewest
        places (rows with a slot or admitted, waiting for one)."""
        held: dict[str, int] = {}
        for lv in self.live:
            held[lv.group.tenant] = held.get(lv.group.tenant, 0) + 1
        for q in self.prefilling + self.ready:
            held[q.tenant] = held.get(q.tenant, 0) + len(q.rows)
        return min(self.waiting, key=lambda g: (not g.resumed, held.get(g.tenant, 0), g.rows[0].serial))

    def _admit_group(self, g: Group) -> bool:
        """Admit waiting request `g` if the pool has room for its prompt, its first row's first call and
        the live rows' next call."""
        # the cache may hold every page but the last token's: that token is always prefilled (its hidden state
        # gives the rows their first token)
        hits = self.kv.lookup(g.identity, g.prompt[: g.prefix - 1])
        if not self.kv.can_admit(g.prefix, hits, self._last(g, g.rows[0]), self.live, self.call_steps):
            self.kv.free(hits)
            return False
        g.pages = self.kv.allocate(g.prefix, hits)
        g.prefilled = self.kv.cached_tokens(hits)
        g.first = self.device.firsts.take()
        if g.cached is None:  # its first admission (a re-admission reads what it wrote itself)
            g.cached = 0 if g.resumed else g.prefilled
        self.stats["prefill_tokens_cached"] += g.prefilled
        self.waiting.remove(g)
        self.prefilling.append(g)
        return True

    def _admit_rows(self) -> None:
        """Give waiting rows of prefilled prompts free slots."""
        while self.ready and len(self.live) < self.slots:
            g = self.ready[0]
            row = g.rows[0]
            last = self._last(g, row)
            pages = self.kv.allocate_row(g.pages, g.prefix, last, self.call_steps)
            if pages is None:
                if self.live:  # decoding rows free pages as they leave
                    break
                # nothing decodes, so nothing else would free pages: release the requests no slot reads yet
                # (youngest first) until this row fits, which it then does (`kv_cache.min_pool_pages`)
                if not self._free_room(partial(self.kv.can_allocate_row, g.prefix, last, self.call_steps), g):
                    raise RuntimeError(f"a row of a {g.prefix}-position prompt does not fit the pool alone")
                continue
            if not g.resumed:
                row.result.cached_prompt_tokens = g.cached
            self.live.append(Live(row, g, pages.table, pages.own, g.prefix - 1, int(g.prompt[-1]), last, pages.copy,
                                  first=g.first))
            g.rows.pop(0)
            g.live += 1
            if not g.rows:
                self.ready.pop(0)
                # its rows' first calls read the slot; a prefill that writes it again runs after them
                self.device.firsts.give(g.first)
                g.first = -1

    def _last(self, g: Group, row: Row) -> int:
        """The last position `row` writes: that of the input of its last token (its first token has none: it
        comes from the prompt's last position, which the prefill writes)."""
        return g.prefix + row.spec.max_tokens - len(row.result.tokens) - 2

    def _grow(self) -> None:
        """Pages for every live row's next call, oldest row first; preempt the youngest when they run out."""
        i = 0
        while i < len(self.live):
            lv = self.live[i]
            grown = self.kv.grow(lv, self.call_steps)
            while not grown and self._free_room(partial(self.kv.can_grow, [lv], self.call_steps), lv):
                grown = self.kv.grow(lv, self.call_steps)
            if not grown:  # this row is the youngest left: it waits
                self._preempt(lv)
                continue
            i += 1

    def _free_room(self, fits: Callable[[], bool], keep: Live | Group) -> bool:
        """Release pages until `fits()` (the next call of live row `keep`, or the first row of admitted
        request `keep` taking a slot): admitted requests no slot reads yet first (youngest first; their
        prompts are prefilled again later), then the youngest live rows. False when only `keep` is left to
        take them from."""
        idle = [g for g in self.ready + self.prefilling if g.live == 0 and g.pages and g is not keep]
        for g in sorted(idle, key=lambda g: g.rows[0].serial, reverse=True):
            if fits():
                return True
            (self.ready if g in self.ready else self.prefilling).remove(g)
            self._unadmit(g)
        if fits():
            return True
        if not self.live or self.live[-1] is keep:
            return False
        self._preempt(self.live[-1])
        return True

    def _unadmit(self, g: Group) -> None:
        self._publish(g.adapter, g.identity, g.prompt[: g.prefilled], g.pages)
        self.kv.free(g.pages)
        self.device.firsts.give(g.first)
        g.pages, g.prefilled, g.first = [], 0, -1
        self.waiting.insert(0, g)

    def _preempt(self, lv: Live) -> None:
        """Take `lv`'s slot and pages; it resumes later with prompt + its tokens so far as its prompt."""
        self.stats["preempted"] += 1
        self.live.remove(lv)
        lv.alive = False
        identity = self._resume_identity(lv)
        self._publish(lv.group.adapter, identity, self._written(lv), lv.table)
        self._leave(lv)
        prompt = np.concatenate([lv.row.spec.prompt, np.asarray(lv.row.result.tokens, np.int32)]).astype(np.int32)
        g = Group([lv.row], prompt, lv.group.adapter, identity, resumed=True, tenant=lv.group.tenant)
        # resumed rows go first, oldest first
        at = sum(1 for w in self.waiting if w.resumed and w.rows[0].serial < lv.row.serial)
        self.waiting.insert(at, g)

    def _resume_identity(self, lv: Live) -> str | None:
        """The prefix-cache key of a preempted row's pages: its weights' own key where those may be shared
        across requests, else a key only this row uses (rows on shared weights never read others' pages)."""
        if not self.kv.prefix_cache:
            return None
        return lv.group.identity or f"row:{lv.row.serial}:{lv.group.adapter}"

    def _publish(self, adapter: int, identity: str | None, tokens: np.ndarray, pages: list[int]) -> None:
        """Offer `pages` to the prefix cache under `identity`, remembered under `adapter`, whose next weight
        change drops them (`weights_change`)."""
        if identity is not None:
            self.published.setdefault(adapter, set()).add(identity)
        self.kv.publish(identity, tokens, pages)

    def weights_change(self, adapter: int) -> None:
        """Adapter `adapter`'s weights change (no row reads it: `reads`): the pages cached under the
        identities its rows used name weights no request will name again, so they are free again, and handed
        out before pages never written (on CPU a pool page costs memory once written: `PagedDevice`)."""
        self.stats["pages_uncached"] += self.kv.forget(self.published.pop(adapter, set()))

    def _leave(self, lv: Live) -> None:
        self.kv.free(lv.own)
        g = lv.group
        g.live -= 1
        if g.live == 0 and not g.rows and g.pages:
            self.kv.free(g.pages)
            g.pages = []

    def _finish(self, lv: Live) -> None:
        self.live.remove(lv)
        lv.alive = False
        self._publish(lv.group.adapter, lv.group.identity, self._written(lv), lv.table)  # its K/V stays reusable
        self._leave(lv)
        self._done.append((lv.row.tag, lv.row.result))

    @staticmethod
    def _written(lv: Live) -> np.ndarray:
        """The tokens whose K/V `lv`'s table holds: its request's prompt, then its sampled tokens but the last."""
        tokens = np.concatenate([lv.row.spec.prompt, np.asarray(lv.row.result.tokens, np.int32)])
        return tokens[: lv.pos].astype(np.int32)
