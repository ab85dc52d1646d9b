"""JaxBackend.sample: validated rows -> bucketed, chunked decode calls -> per-request SampleOutput.

Rows are grouped into chunks of at most `sample_max_num_sequences`, padded to a bucketed row count,
prompt length, new-token count and stop-list length, so the number of compiled programs stays small and
parameter values never cause a recompile. Stop strings are applied on the host after decoding (the
device loop exits early on stop tokens and EOS only).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from tx import types
from tx.backends.batching import bucket_length, bucket_rows
from tx.models.logprobs import chunked_logprob_stats
from tx.models.sharding import batch_spec, put_global, to_host
from tx.sampling.decode import DecodeInputs, generate
from tx.sampling.requests import SampleLimits, SampleRow, truncate_at_stop_string, validate

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

    def _decode_chunk(self, rows: list[SampleRow]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        fsdp = self.backend.mesh.shape["fsdp"]
        cap = self.backend.config.sample_max_num_sequences
        b = bucket_rows(len(rows), fsdp)
        if cap:
            b = min(b, -(-cap // fsdp) * fsdp)
        p = bucket_length(max(len(r.prompt) for r in rows))
        max_new = bucket_length(max(r.max_tokens for r in rows))
        s = _pow2(max(len(r.stop_tokens) for r in rows), 4)
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
        fn = self._jit(("sample", b, p, max_new, s), generate, ("max_new",))
        out = self.backend._run("sample", fn, self.backend.model, DecodeInputs(**self._put(arrays)), max_new=max_new)
        return tuple(to_host(x) for x in out)  # type: ignore[return-value]

    # ---- prompt log-probs ----

    def _score_prompts(self, prompts: list[tuple[np.ndarray, int]], top_k: int):
        """Per prompt: log-prob of each next prompt token [n - 1], and top-k (ids, log-probs) [n - 1, k]."""
        fsdp = self.backend.mesh.shape["fsdp"]
        b, p = bucket_rows(len(prompts), fsdp), bucket_length(max(len(x) for x, _ in prompts))
        k = _pow2(top_k, 1) if top_k else 0
        ids = np.zeros((b, p), np.int32)
        mask = np.zeros((b, p), np.int32)
        adapters = np.zeros(b, np.int32)
        for i, (prompt, adapter) in enumerate(prompts):
            ids[i, : len(prompt)], mask[i, : len(prompt)], adapters[i] = prompt, 1, adapter
        chunk = self.backend.config.loss_chunk_size

        def score(model, ids_bt, mask_bt, adapter_b, k):
            hidden = model(ids_bt, mask_bt, adapter_b)
            return chunked_logprob_stats(model.logits, hidden, jnp.roll(ids_bt, -1, axis=1), adapter_b, chunk, k)

        fn = self._jit(("score_prompts", b, p, k), score, ("k",))
        arrays = self._put({"ids": ids, "mask": mask, "adapters": adapters})
        target, top_ids, top_lp = self.backend._run(
            "score_prompts", fn, self.backend.model, arrays["ids"], arrays["mask"], arrays["adapters"], k=k)
        target = to_host(target)
        top_ids = None if top_ids is None else to_host(top_ids)[..., :top_k]
        top_lp = None if top_lp is None else to_host(top_lp)[..., :top_k]
        out = []
        for i, (prompt, _) in enumerate(prompts):
            n = len(prompt) - 1
            out.append((target[i, :n], None if top_ids is None else top_ids[i, :n], None if top_lp is None else top_lp[i, :n]))
        return out

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
        )
        pinned: set[int] = set()  # sampler-checkpoint slots this batch uses: not to be evicted mid-batch

        def adapter_of(model_id: str, checkpoint_path: str) -> int:
            if checkpoint_path:
                try:
                    slot = backend._sampler_slot(checkpoint_path, pinned)
                except Exception as e:  # noqa: BLE001 - fails this request only; the message names the checkpoint
                    message = str(e.args[0]) if e.args else f"{type(e).__name__}: {e}"
                    if not isinstance(e, (KeyError, ValueError, FileNotFoundError)):
                        message = f"{type(e).__name__}: {message}"
                    if checkpoint_path not in message:
                        message = f"sampler checkpoint {checkpoint_path}: {message}"
                    raise ValueError(message) from e
                pinned.add(slot)
                return slot
            return backend._slot(model_id) if model_id else 0

        rows, errors = validate(batch, adapter_of, limits)
        results: dict[str, types.SampleOutput | types.ErrorResponse] = {
            batch.request_batch_slices[r][0]: types.ErrorResponse(error=msg) for r, msg in errors.items()
        }
        sequences: list[types.GeneratedSequence | None] = [None] * len(rows)
        for idx in self._chunk_rows(rows):
            chunk = [rows[i] for i in idx]
            tokens, logprobs, lengths, stopped = self._decode_chunk(chunk)
            for j, i in enumerate(idx):
                n = int(lengths[j])
                toks, lps = tokens[j, :n].tolist(), logprobs[j, :n].tolist()
                reason = "stop" if stopped[j] else "length"
                cut = truncate_at_stop_string(toks, rows[i].stop_strings, self.decode_text)
                if cut is not None:
                    toks, lps, reason = toks[:cut], lps[:cut], "stop"
                sequences[i] = types.GeneratedSequence(tokens=toks, logprobs=lps, stop_reason=reason)
        by_request: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_request.setdefault(row.request_index, []).append(i)
        scored = [r for r in by_request if batch.request_batch_slices[r][4] or batch.request_batch_slices[r][5]]
        scores = {}
        if scored:
            top_k = max(batch.request_batch_slices[r][5] for r in scored)
            prompts = [(rows[by_request[r][0]].prompt, rows[by_request[r][0]].adapter) for r in scored]
            scores = dict(zip(scored, self._score_prompts(prompts, top_k)))
        for r, members in by_request.items():
            request_id, _, _, _, want_logprobs, want_topk = batch.request_batch_slices[r]
            output = types.SampleOutput(sequences=[sequences[i] for i in members])
            if r in scores:
                target, top_ids, top_lp = scores[r]
                if want_logprobs:
                    output.prompt_logprobs = [None] + [float(x) for x in target]
                if want_topk:
                    output.topk_prompt_logprobs = [None] + [
                        [(int(t), float(v)) for t, v in zip(top_ids[pos, :want_topk], top_lp[pos, :want_topk])]
                        for pos in range(len(target))
                    ]
            results[request_id] = output
        return results
