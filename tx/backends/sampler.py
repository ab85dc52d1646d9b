"""JaxBackend.sample: validated rows -> bucketed, chunked decode calls -> per-request SampleOutput.

Rows are grouped into chunks of at most `sample_max_num_sequences`, padded to a bucketed row count,
prompt length, new-token count and stop-list length, so the number of compiled programs stays small and
parameter values never cause a recompile. Stop strings are applied on the host after decoding (the
device loop exits early on stop tokens and EOS only).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from tx import types
from tx.backends.batching import bucket_length, bucket_rows
from tx.models.sharding import batch_spec, put_global, to_host
from tx.sampling.continuous import PagedEngine
from tx.sampling.decode import DecodeInputs, DecodeOutputs, generate
from tx.sampling.outputs import prompt_output, sequence_of
from tx.sampling.prompt_scores import PromptScoreInputs, PromptScores, score_prompts
from tx.sampling.requests import SampleLimits, SampleRow, validate

if TYPE_CHECKING:
    from tx.backends.jax import JaxBackend


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
    return ()


def _pow2(n: int, minimum: int) -> int:
    return max(minimum, 1 << (max(1, n) - 1).bit_length())


class Sampler:
    def __init__(self, backend: JaxBackend, model_dir: Path):
        self.backend = backend
        self.model_dir = model_dir
        self.eos_ids = eos_token_ids(model_dir)
        self._tokenizer = None
        # the paged engine (its KV pool is allocated at first use); a pool too small fails here, at startup
        self._paged = PagedEngine(self) if backend.config.sample_engine == "paged" else None

    def decode_text(self, tokens: list[int]) -> str:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        return self._tokenizer.decode(tokens, skip_special_tokens=False)

    def _put(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        mesh = self.backend.mesh
        return {k: put_global(v, NamedSharding(mesh, batch_spec(v.ndim))) for k, v in arrays.items()}

    def _jit(self, key: tuple, fn: Callable, static: tuple[str, ...]) -> Callable:
        backend = self.backend
        return backend._fn(key, lambda: nnx.jit(self._counting(key[0], fn), static_argnames=static))

    def _counting(self, name: str, fn: Callable) -> Callable:
        on_trace = self.backend._counted(name)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            on_trace()
            return fn(*args, **kwargs)

        return wrapped

    # ---- decode ----

    def _chunk_rows(self, rows: list[SampleRow]) -> list[list[int]]:
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].prompt))
        cap = self.backend.config.sample_max_num_sequences or max(1, len(order))
        return [order[i : i + cap] for i in range(0, len(order), cap)]

    def _decode_chunk(self, rows: list[SampleRow]) -> DecodeOutputs:
        fsdp = self.backend.mesh.shape["fsdp"]
        cap = self.backend.config.sample_max_num_sequences
        b = bucket_rows(len(rows), fsdp)
        if cap:
            b = min(b, -(-cap // fsdp) * fsdp)
        p = bucket_length(max(len(r.prompt) for r in rows))
        max_new = bucket_length(max(r.max_tokens for r in rows))
        s = _pow2(max(len(r.stop_tokens) for r in rows), 4)
        want_topk = max(r.options.topk_sample_logprobs for r in rows)
        topk = _pow2(want_topk, 1) if want_topk else 0
        arrays = {
            "prompt_bt": np.zeros((b, p), np.int32),
            "prompt_len_b": np.ones(b, np.int32),
            "adapter_b": np.zeros(b, np.int32),
            "max_tokens_b": np.zeros(b, np.int32),
            "temperature_b": np.zeros(b, np.float32),
            "top_k_b": np.zeros(b, np.int32),
            "top_p_b": np.ones(b, np.float32),
            "seed_b": np.zeros(b, np.uint32),
            "stop_bs": np.full((b, s), -1, np.int32),
        }
        for i, row in enumerate(rows):
            arrays["prompt_bt"][i, : len(row.prompt)] = row.prompt
            arrays["prompt_len_b"][i] = len(row.prompt)
            arrays["adapter_b"][i] = row.adapter
            arrays["max_tokens_b"][i] = row.max_tokens
            arrays["temperature_b"][i] = row.temperature
            arrays["top_k_b"][i] = row.top_k
            arrays["top_p_b"][i] = row.top_p
            arrays["seed_b"][i] = row.seed
            arrays["stop_bs"][i, : len(row.stop_tokens)] = row.stop_tokens
        fn = self._jit(("sample", b, p, max_new, s, topk), generate, ("max_new", "topk"))
        out = self.backend._run("sample", fn, self.backend.model, DecodeInputs(**self._put(arrays)), max_new=max_new,
                                topk=topk)
        return DecodeOutputs(*(None if x is None else to_host(x) for x in out))

    # ---- prompt scores (prompt_logprobs, topk_prompt_logprobs, target_prompt_logprobs, prompt_alt_tokens) ----

    def _score_prompts(self, rows: list[SampleRow], top_k: int) -> PromptScores:
        """Scores of each row's prompt (row i of the result = rows[i]), on the host; top-k width `top_k`."""
        fsdp = self.backend.mesh.shape["fsdp"]
        b, p = bucket_rows(len(rows), fsdp), bucket_length(max(len(r.prompt) for r in rows))
        k = _pow2(top_k, 1) if top_k else 0
        want_alt = max(r.options.prompt_alt_tokens_k for r in rows)
        alt = _pow2(want_alt, 1) if want_alt else 0
        want_m = max((r.targets.width for r in rows if r.targets is not None), default=0)
        m = _pow2(want_m, 1) if want_m else 0
        arrays = {"ids_bt": np.zeros((b, p), np.int32), "mask_bt": np.zeros((b, p), np.int32),
                  "adapter_b": np.zeros(b, np.int32), "target_ids_btm": np.full((b, p, m), -1, np.int32),
                  "temperature_b": np.zeros(b, np.float32), "seed_b": np.zeros(b, np.uint32)}
        for i, row in enumerate(rows):
            n = len(row.prompt)
            arrays["ids_bt"][i, :n], arrays["mask_bt"][i, :n], arrays["adapter_b"][i] = row.prompt, 1, row.adapter
            arrays["temperature_b"][i], arrays["seed_b"][i] = row.temperature, row.seed
            if row.targets is not None:
                arrays["target_ids_btm"][i, : n - 1, : row.targets.width] = row.targets.device_ids(n - 1)
        chunk = self.backend.config.loss_chunk_size
        fn = self._jit(("score_prompts", b, p, k, m, alt), score_prompts, ("chunk_size", "top_k", "alt_k"))
        out = self.backend._run("score_prompts", fn, self.backend.model, PromptScoreInputs(**self._put(arrays)),
                                chunk_size=chunk, top_k=k, alt_k=alt)
        return PromptScores(*(None if x is None else to_host(x) for x in out))

    # ---- the call ----

    def sample(self, batch: types.PreparedSampleBatch) -> dict[str, types.SampleOutput | types.ErrorResponse]:
        backend = self.backend
        limits = SampleLimits(
            vocab=backend.model.config.vocab_size,
            max_seq_len=backend.max_seq_len,
            max_num_samples=backend.config.max_num_samples,
            eos_ids=self.eos_ids,
            default_max_tokens=backend.config.default_max_tokens,
            max_topk_prompt_logprobs=backend.config.max_topk_prompt_logprobs,
            max_target_prompt_logprobs=backend.config.max_target_prompt_logprobs,
        )
        pinned: set[int] = set()  # sampler-checkpoint slots this batch uses: not to be evicted mid-batch

        def adapter_of(model_id: str, checkpoint_path: str) -> int:
            if checkpoint_path:
                try:
                    slot = backend._sampler_slot(checkpoint_path, pinned)
                except Exception as e:
                    message = str(e.args[0]) if e.args else f"{type(e).__name__}: {e}"
                    if not isinstance(e, (KeyError, ValueError, FileNotFoundError)):
                        message = f"{type(e).__name__}: {message}"
                    if checkpoint_path not in message:
                        message = f"sampler checkpoint {checkpoint_path}: {message}"
                    raise ValueError(message) from e
                pinned.add(slot)
                return slot
            return backend._sample_slot(model_id)

        rows, errors = validate(batch, adapter_of, limits)
        results: dict[str, types.SampleOutput | types.ErrorResponse] = {
            batch.request_batch_slices[r][0]: types.ErrorResponse(error=msg) for r, msg in errors.items()
        }
        sequences: list[types.GeneratedSequence | None] = [None] * len(rows)
        cached: dict[int, int] = {}  # request -> prompt tokens read from the prefix cache
        if backend.config.sample_engine == "paged":
            topk = max((r.options.topk_sample_logprobs for r in rows), default=0)
            topk = _pow2(topk, 1) if topk else 0
            for i, res in enumerate(self._paged.run(rows)):
                sequences[i] = sequence_of(res.as_outputs(topk), 0, rows[i], self.decode_text)
                cached[rows[i].request_index] = res.cached_prompt_tokens
        else:
            for idx in self._chunk_rows(rows):
                out = self._decode_chunk([rows[i] for i in idx])
                for j, i in enumerate(idx):
                    sequences[i] = sequence_of(out, j, rows[i], self.decode_text)
        by_request: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_request.setdefault(row.request_index, []).append(i)
        slices = batch.request_batch_slices
        scored = [r for r, members in by_request.items()
                  if slices[r][4] or slices[r][5] or rows[members[0]].targets is not None
                  or rows[members[0]].options.prompt_alt_tokens_k]
        scores, score_row = None, {r: i for i, r in enumerate(scored)}
        if scored:  # one prefill per scored request (its first row: every row of a request has its prompt)
            scores = self._score_prompts([rows[by_request[r][0]] for r in scored], max(slices[r][5] for r in scored))
        for r, members in by_request.items():
            request_id, _, _, _, want_logprobs, want_topk = slices[r]
            output = types.SampleOutput(sequences=[sequences[i] for i in members],
                                        prompt_cache_hit_tokens=cached.get(r, 0))
            if r in score_row:
                output = prompt_output(output, scores, score_row[r], rows[members[0]], want_logprobs, want_topk)
            results[request_id] = output
        return results
