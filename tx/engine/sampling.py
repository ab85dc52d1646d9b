"""Sampling requests in flight, and how they share the device with training (the engine thread's side).

Sampling requests are submitted to their backend as rounds take them (`sample_submit`) and then advanced
one engine iteration at a time (`sample_step`: a prefill chunk call and a few decode steps), so a request
that arrives while others run joins them at the next iteration and leaves the iteration it ends.

Fairness between sampling and training (`sampling_share`, default 0.5): the engine alternates.
- A round runs the training ops that are ready (every tenant's passes in one call, then single ops) and
  submits the sampling requests queued meanwhile.
- Then sampling runs for at least one iteration, and for as long as nothing else waits. When training
  requests are waiting, sampling stops after `share / (1 - share)` times the last round's training time
  (share 0.5: as long as training took), and the next round runs.
So a long sampling job cannot keep other tenants' forward_backward out for more than about one round's
time, and a stream of training requests cannot stop sampling: each gets about its share of device time
while both wait, and all of it alone.
"""

from __future__ import annotations

import logging
import time

from tx import types
from tx.engine.ops import Op
from tx.engine.results import error_payload

logger = logging.getLogger(__name__)


class SamplingMixin:
    """Engine methods for sampling requests in flight (`self._in_flight`: request id -> (base, op))."""

    def _submit_samples(self, ops: list[Op]) -> None:
        """Hand queued sampling requests to their backend; they join the requests already running."""
        batch, sequences = self._sample_batch(ops)
        base = ops[0].payload.base_model or self.base_model
        self.count("sample_calls")  # batches handed to the backend together
        if len({op.payload.location for op in ops}) > 1:
            self.count("multi_adapter_sample_calls")
        start = time.time()
        self.telemetry.started(ops, start)
        try:
            refused = self._served(base).sample_submit(batch)
        except Exception as e:  # noqa: BLE001 - every request of the call gets the error
            self.telemetry.call_of("sample_submit", base, start, time.time(), ops, ok=False)
            payload = self._failure(e)
            self._finish([(op.request_id, "failed", payload) for op in ops])
            return
        for op in ops:
            if op.request_id in refused:
                continue
            self._in_flight[op.request_id] = (base, op)
            self._in_flight_sequences += op.size
        self.telemetry.call_of("sample_submit", base, start, time.time(), ops, ok=True)
        self._finish([(op.request_id, "failed", self._error_payload(refused[op.request_id]))
                      for op in ops if op.request_id in refused])
        logger.info('{"event": "sample_submit", "requests": %d, "sequences": %d, "refused": %d}', len(ops),
                    sequences, len(refused))

    def _sample_batch(self, ops: list[Op]) -> tuple[types.PreparedSampleBatch, int]:
        prompts, params, locations, slices, options = [], [], [], [], []
        for op in ops:
            r = op.payload
            start = len(prompts)
            for _ in range(r.num_samples):
                prompts.append(r.prompt)
                params.append(r.params)
                locations.append(r.location)
            slices.append((op.request_id, "", start, len(prompts), r.prompt_logprobs, r.topk_prompt_logprobs))
            options.append(r.options)
        batch = types.PreparedSampleBatch(
            all_prompts=prompts, all_sampling_params=params, all_model_ids=[""] * len(prompts),
            all_checkpoint_ids=locations, all_checkpoint_paths=locations, request_batch_slices=slices,
            request_options=options, request_tenants=[op.owner or "" for op in ops])
        return batch, len(prompts)

    def _sampling_active(self) -> bool:
        return bool(self._in_flight)

    def _run_sampling(self, trained_s: float) -> None:
        """Advance the requests in flight: at least one iteration, then more while no other work waits or,
        when some does, until sampling has had its share of the time the last round's training took."""
        share = self.config.sampling_share
        budget = trained_s * share / (1.0 - share) if share < 1.0 else float("inf")
        started = time.perf_counter()
        while self._in_flight:
            self._sample_iteration()
            with self.cond:
                others = self._stop or self._ending or self.scheduler.pending(time.time())
            if others and time.perf_counter() - started >= budget:
                return

    def _sample_iteration(self) -> None:
        for base in sorted({base for base, _ in self._in_flight.values()}):
            started = time.perf_counter()
            backend = self._served(base)
            shares, start = self.telemetry.sampling_shares(base), time.time()
            before = _sampled_tokens(backend)
            try:
                outputs = backend.sample_step()
            except Exception as e:  # noqa: BLE001 - the backend dropped its requests in flight: all fail
                self.telemetry.call("sample_step", base, start, time.time(), sum(r for r, _ in shares.values()), 0,
                                    False, shares)
                payload = self._failure(e)
                ids = [rid for rid, (b, _) in self._in_flight.items() if b == base]
                for rid in ids:
                    self._in_flight_sequences -= self._in_flight.pop(rid)[1].size
                self._finish([(rid, "failed", payload) for rid in ids])
                continue
            self.count("sample_steps")
            tokens = _sampled_tokens(backend) - before
            if len(shares) == 1:  # one session's rows only: the step's tokens are all its own
                shares = {s: (r, tokens) for s, (r, _) in shares.items()}
            self.telemetry.call("sample_step", base, start, time.time(), sum(r for r, _ in shares.values()), tokens,
                                True, shares)
            results = []
            for request_id, out in outputs.items():
                if (entry := self._in_flight.pop(request_id, None)) is None:
                    continue  # not ours (sampled in-process on the same backend)
                self._in_flight_sequences -= entry[1].size
                if isinstance(out, types.ErrorResponse):
                    results.append((request_id, "failed", self._error_payload(out)))
                else:
                    self.telemetry.produced(request_id, sum(len(seq.tokens) for seq in out.sequences))
                    results.append((request_id, "done", self.encode_sample(out)))
            if results:
                logger.info('{"event": "sample", "finished": %d, "in_flight": %d, "seconds": %.4f}', len(results),
                            len(self._in_flight), time.perf_counter() - started)
                self._finish(results)

    def _fail_in_flight(self, message: str) -> None:
        ids, self._in_flight, self._in_flight_sequences = list(self._in_flight), {}, 0
        self._finish([(rid, "failed", error_payload(message, "server")) for rid in ids])

    @staticmethod
    def _error_payload(out: types.ErrorResponse):
        return error_payload(out.error, "user")


def _sampled_tokens(backend) -> int:
    """Tokens the backend's sampling engine prefilled and decoded so far (0 where it does not count them)."""
    stats = getattr(getattr(backend, "metrics", None), "sampling", None) or {}
    return stats.get("prefill_tokens", 0) + stats.get("decode_tokens", 0)
