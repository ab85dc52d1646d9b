"""Sampling requests -> per-request SampleOutput, over the weights of a `WeightsSource` (a backend's
`sample`, `sample_submit` and `sample_step` are these): validated rows run in the paged engine
(`continuous.PagedEngine`: requests join and leave between its device calls); prompt scores come from one
prefill per request that asks for them. A stop string ends its row on the device when sampled as the
tokenizer writes it, else at the host's check after the call; the answer is cut at the stop when assembled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tx import types
from tx.models.sharding import to_host
from tx.runtime import Runtime, bucket_length, bucket_rows, pow2
from tx.sampling.continuous import PagedEngine
from tx.sampling.outputs import prompt_output, sequence_of
from tx.sampling.prompt_scores import PromptScoreInputs, PromptScores, score_prompts
from tx.sampling.requests import SampleLimits, SampleRow, validate
from tx.sampling.source import SamplingSettings, WeightsSource
from tx.sampling.text import TextCodec


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
    return ()


def pow2_at_least(n: int, minimum: int) -> int:
    return max(minimum, pow2(n))


class Sampler:
    def __init__(self, source: WeightsSource, runtime: Runtime, config: SamplingSettings):
        self.source, self.runtime, self.config = source, runtime, config
        self.eos_ids = eos_token_ids(source.model_dir)
        self.text = TextCodec(source.model_dir)
        self.decode_text, self.encode_text = self.text.decode_text, self.text.encode_text
        # the paged engine (its KV pool is allocated at first use); a pool too small fails here, at startup
        self.paged = PagedEngine(source, runtime, config, self.text)
        self._requests: dict[str, _Request] = {}  # submitted, not finished
        self._finished: dict[str, types.SampleOutput] = {}  # finished, not yet returned by `step`

    # ---- prompt scores (prompt_logprobs, topk_prompt_logprobs, target_prompt_logprobs, prompt_alt_tokens) ----

    def _score_prompts(self, rows: list[SampleRow], top_k: int) -> PromptScores:
        """Scores of each row's prompt (row i of the result = rows[i]), on the host; top-k width `top_k`."""
        fsdp = self.runtime.mesh.shape["fsdp"]
        b, p = bucket_rows(len(rows), fsdp), bucket_length(max(len(r.prompt) for r in rows))
        k = pow2_at_least(top_k, 1) if top_k else 0
        want_alt = max(r.options.prompt_alt_tokens_k for r in rows)
        alt = pow2_at_least(want_alt, 1) if want_alt else 0
        want_m = max((r.targets.width for r in rows if r.targets is not None), default=0)
        m = pow2_at_least(want_m, 1) if want_m else 0
        arrays = {"ids_bt": np.zeros((b, p), np.int32), "mask_bt": np.zeros((b, p), np.int32),
                  "adapter_b": np.zeros(b, np.int32), "target_ids_btm": np.full((b, p, m), -1, np.int32),
                  "temperature_b": np.zeros(b, np.float32), "seed_b": np.zeros(b, np.uint32)}
        for i, row in enumerate(rows):
            n = len(row.prompt)
            arrays["ids_bt"][i, :n], arrays["mask_bt"][i, :n], arrays["adapter_b"][i] = row.prompt, 1, row.adapter
            arrays["temperature_b"][i], arrays["seed_b"][i] = row.temperature, row.seed
            if row.targets is not None:
                arrays["target_ids_btm"][i, : n - 1, : row.targets.width] = row.targets.device_ids(n - 1)
        chunk = self.config.loss_chunk_size
        fn = self.runtime.jit(("score_prompts", b, p, k, m, alt), score_prompts, ("chunk_size", "top_k", "alt_k"))
        out = self.runtime.run("score_prompts", fn, self.source.model,
                               PromptScoreInputs(**self.runtime.put_batch(arrays)), chunk_size=chunk, top_k=k,
                               alt_k=alt)
        return PromptScores(*(None if x is None else to_host(x) for x in out))

    # ---- requests in flight: submit, step, and the one-call form ----

    def limits(self) -> SampleLimits:
        """What `validate` checks each row against (vocabulary, lengths, samples, EOS, top-k limits)."""
        config = self.config
        return SampleLimits(
            vocab=self.source.model.config.vocab_size,
            max_seq_len=self.source.max_seq_len,
            max_num_samples=config.max_num_samples,
            eos_ids=self.eos_ids,
            default_max_tokens=config.default_max_tokens,
            max_topk_prompt_logprobs=config.max_topk_prompt_logprobs,
            max_target_prompt_logprobs=config.max_target_prompt_logprobs,
        )

    @property
    def active(self) -> bool:
        """Whether submitted requests are unfinished or finished but not yet returned by `step`."""
        return bool(self._requests) or bool(self._finished)

    def slots_read(self) -> set[int]:
        """Adapter slots the unfinished requests sample from (kept out of sampler-checkpoint eviction)."""
        return {row.adapter for req in self._requests.values() for row in req.rows}

    def submit(self, batch: types.PreparedSampleBatch) -> dict[str, types.ErrorResponse]:
        """Validate and queue a batch's requests; the ones refused (each with its error). The others' results
        come from `step`. Prompt scores are computed here (one prefill per request that asks for them)."""
        source = self.source
        pinned: set[int] = self.slots_read()  # slots this batch and unfinished requests use: not to be evicted

        def adapter_of(model_id: str, checkpoint_path: str) -> int:
            if checkpoint_path:
                try:
                    slot = source.sampler_slot(checkpoint_path, pinned)
                except Exception as e:
                    message = str(e.args[0]) if e.args else f"{type(e).__name__}: {e}"
                    if not isinstance(e, (KeyError, ValueError, FileNotFoundError)):
                        message = f"{type(e).__name__}: {message}"
                    if checkpoint_path not in message:
                        message = f"sampler checkpoint {checkpoint_path}: {message}"
                    raise ValueError(message) from e
                pinned.add(slot)
                return slot
            return source.sample_slot(model_id)

        rows, errors = validate(batch, adapter_of, self.limits())
        refused = {batch.request_batch_slices[r][0]: types.ErrorResponse(error=msg) for r, msg in errors.items()}
        by_request: dict[int, list[SampleRow]] = {}
        for row in rows:
            by_request.setdefault(row.request_index, []).append(row)
        slices = batch.request_batch_slices
        requests = [_Request(slices[r][0], members, slices[r][4], slices[r][5]) for r, members in by_request.items()]
        scored = [q for q in requests if q.want_logprobs or q.want_topk or q.rows[0].targets is not None
                  or q.rows[0].options.prompt_alt_tokens_k]
        if scored:  # one prefill per scored request (its first row: every row of a request has its prompt)
            scores = self._score_prompts([q.rows[0] for q in scored], max(q.want_topk for q in scored))
            for i, q in enumerate(scored):
                q.scores = (scores, i)
        for q in requests:
            if q.request_id in self._requests:
                raise ValueError(f"request {q.request_id} is already being sampled")
            self._requests[q.request_id] = q
            self.paged.add(q.rows, [(q.request_id, j) for j in range(len(q.rows))])
        return refused

    def step(self) -> dict[str, types.SampleOutput]:
        """Advance the unfinished requests by one iteration of the paged engine; the requests that finished.
        A failure fails every unfinished request (the caller reports it)."""
        try:
            if self._requests:
                self._collect(self.paged.step())
        except BaseException:
            self._requests.clear()
            self._finished.clear()
            self.paged.reset()
            raise
        out, self._finished = self._finished, {}
        return out

    def before_weights_change(self, slot: int) -> None:
        """Adapter `slot`'s weights are about to change: finish the requests that sample from it first, so
        none mixes tokens of two versions (their results wait for the next `step`); the pages cached with
        the old weights are free again."""
        while self.paged.reads(slot):
            self._collect(self.paged.step())
        self.paged.weights_change(slot)

    def sample(self, batch: types.PreparedSampleBatch) -> dict[str, types.SampleOutput | types.ErrorResponse]:
        """Every request of `batch` sampled to the end (requests submitted before keep their results for
        `step`)."""
        results: dict[str, types.SampleOutput | types.ErrorResponse] = dict(self.submit(batch))
        mine = {s[0] for s in batch.request_batch_slices} - set(results)
        others: dict[str, types.SampleOutput] = {}
        while mine - set(results):
            for request_id, output in self.step().items():
                (results if request_id in mine else others)[request_id] = output
        self._finished.update(others)
        return results

    def _collect(self, finished) -> None:
        """Store finished rows of the paged engine; a request whose rows all ended gets its output."""
        for (request_id, j), res in finished:
            q = self._requests[request_id]
            row = q.rows[j]
            q.sequences[j] = sequence_of(res, row, self.decode_text)
            q.cached = max(q.cached, res.cached_prompt_tokens)
            q.left -= 1
            if not q.left:
                self._finished[request_id] = self._output(self._requests.pop(request_id))

    def _output(self, q: _Request) -> types.SampleOutput:
        output = types.SampleOutput(sequences=q.sequences, prompt_cache_hit_tokens=q.cached)
        if q.scores is not None:
            output = prompt_output(output, q.scores[0], q.scores[1], q.rows[0], q.want_logprobs, q.want_topk)
        return output


@dataclass
class _Request:
    """A submitted request until its every row has ended."""

    request_id: str
    rows: list[SampleRow]
    want_logprobs: bool
    want_topk: int
    scores: tuple[PromptScores, int] | None = None  # its prompt scores: (the scoring call's outputs, its row)
    sequences: list[types.GeneratedSequence | None] = field(default_factory=list)
    cached: int = 0  # prompt tokens read from the prefix cache
    left: int = 0

    def __post_init__(self):
        self.sequences = [None] * len(self.rows)
        self.left = len(self.rows)
