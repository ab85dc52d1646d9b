"""Sampling requests on the host: per-request validation, per-row parameters, stop strings.

Rows: every sample of every request is one row (`request_batch_slices` give each request's rows). A
request with any bad value gets one error naming the field and value; the others go on.

Defaults and limits: max_tokens=None means min(default_max_tokens, room left in the context), so a
request that names no length cannot size every row's KV cache to the whole context; top_k >= vocab keeps
every token (the same distribution as no top-k), so it is clamped to "off" rather than refused;
topk_prompt_logprobs is capped by max_topk_prompt_logprobs (and the vocabulary); so are the other top-k
widths of SDK >= 0.32, topk_sample_logprobs and prompt_alt_tokens_k, which the SDK says the server bounds
"the way it bounds a top-k width". target_prompt_logprobs: tx.sampling.targets. min_p is in [0, 1] (0 = off)
and repetition_penalty > 0 (1 = off), as vLLM.

Stops: None = the model's EOS tokens; [] = never stop early; a non-empty list = EOS plus those stops
(as Tinker: stop strings do not switch EOS off).

Seeds: a row uses `seed + i` for the i-th sample of its request; with no seed, `seed` is derived from
the request id (crc32), which is the same on every host and for retries of the same request.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tx import types
from tx.sampling.targets import TargetPlan, plan

logger = logging.getLogger(__name__)


@dataclass
class SampleRow:
    request_index: int
    prompt: np.ndarray  # int32 [n]
    adapter: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_tokens: list[int]
    stop_strings: list[str]
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    options: types.SampleOptions = field(default_factory=types.SampleOptions)  # the request's SDK >= 0.32 fields
    targets: TargetPlan | None = None  # the request's target_prompt_logprobs, checked
    tenant: str = ""  # who sent it: the prefix cache partition of rows on weights tenants share ("" = none)


@dataclass(frozen=True)
class SampleLimits:
    vocab: int
    max_seq_len: int
    max_num_samples: int
    eos_ids: tuple[int, ...]
    default_max_tokens: int = 0  # used when max_tokens is None; 0 = the whole room left in the context
    max_topk_prompt_logprobs: int = 20
    max_target_prompt_logprobs: int = 64  # ids named at one prompt position


def _check_params(p: types.SamplingParams, prompt_len: int, limits: SampleLimits) -> int:
    """Validate one request's parameters; return its effective max_tokens."""
    room = limits.max_seq_len - prompt_len
    if room < 1:
        raise ValueError(f"prompt of {prompt_len} tokens leaves no room under max_seq_len={limits.max_seq_len}")
    if p.max_tokens is None:
        max_tokens = min(room, limits.default_max_tokens) if limits.default_max_tokens else room
    else:
        max_tokens = p.max_tokens
    if max_tokens < 0:
        raise ValueError(f"max_tokens = {max_tokens} must be >= 0")
    if max_tokens > room:
        raise ValueError(
            f"prompt of {prompt_len} tokens + max_tokens = {max_tokens} exceeds max_seq_len={limits.max_seq_len}"
        )
    # checked as the device holds them (float32): 1e39 is finite in Python but inf on device
    temperature, top_p = np.float32(p.temperature), np.float32(p.top_p)
    if not np.isfinite(temperature) or temperature < 0 or 0 < temperature < np.finfo(np.float32).tiny:
        raise ValueError(f"temperature = {p.temperature} must be 0 or a normal float32 number > 0")
    if not (np.isfinite(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p = {p.top_p} must be in (0, 1] as a float32")
    with np.errstate(over="ignore"):  # 1e39 -> inf, refused below
        min_p, penalty = np.float32(p.min_p), np.float32(p.repetition_penalty)
    if not (np.isfinite(min_p) and 0 <= min_p <= 1):
        raise ValueError(f"min_p = {p.min_p} must be in [0, 1] as a float32")
    if not np.isfinite(penalty) or penalty < np.finfo(np.float32).tiny:
        raise ValueError(f"repetition_penalty = {p.repetition_penalty} must be a normal float32 number > 0 (1 = off)")
    if p.top_k < -1:
        raise ValueError(f"top_k = {p.top_k} must be -1 (off), 0 (off) or a positive count")
    for s in p.stop or []:
        if isinstance(s, int) and not 0 <= s < limits.vocab:
            raise ValueError(f"stop token {s} is outside the vocabulary [0, {limits.vocab})")
        if isinstance(s, str) and not s:
            raise ValueError("stop strings must be non-empty")
    return max_tokens


def check_options(
    o: types.SampleOptions, prompt_len: int, prompt_logprobs: bool, limits: SampleLimits
) -> TargetPlan | None:
    """Validate a request's SDK >= 0.32 fields (bounds from tinker 0.38 SampleRequest / SamplingClient.sample);
    return its checked target_prompt_logprobs."""
    cap = min(limits.max_topk_prompt_logprobs, limits.vocab)
    for name in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
        value = getattr(o, name)
        if not 0 <= value <= cap:
            raise ValueError(f"{name} = {value} must be in [0, {cap}] (this server's top-k limit)")
    last_n = o.prompt_logprobs_last_n
    if last_n is not None:
        if not prompt_logprobs:
            raise ValueError(f"prompt_logprobs_last_n = {last_n} needs prompt_logprobs")
        if not 1 <= last_n <= prompt_len - 1:
            raise ValueError(f"prompt_logprobs_last_n = {last_n} must be in [1, len(prompt) - 1 = {prompt_len - 1}]")
    if (o.prompt_alt_tokens_k or o.target_prompt_logprobs is not None) and prompt_len < 2:
        raise ValueError("target_prompt_logprobs and prompt_alt_tokens_k need a prompt of at least 2 tokens")
    if o.target_prompt_logprobs is None:
        return None
    return plan(o.target_prompt_logprobs, prompt_len, limits.vocab, limits.max_target_prompt_logprobs)


def effective_top_k(top_k: int, vocab: int) -> int:
    """top_k as the device uses it (int32): k >= vocab keeps every token, i.e. no top-k (-1)."""
    return -1 if top_k >= vocab else top_k


def stop_list(stop: list[int] | list[str] | None, eos_ids: tuple[int, ...]) -> list[int | str]:
    """The stops a row uses: EOS unless the caller sent stop=[] (which switches every stop off)."""
    if stop is None:
        return list(eos_ids)
    if not stop:
        return []
    return list(dict.fromkeys([*eos_ids, *stop]))


def validate(
    batch: types.PreparedSampleBatch, adapter_of: Callable[[str, str], int], limits: SampleLimits
) -> tuple[list[SampleRow], dict[int, str]]:
    rows: list[SampleRow] = []
    errors: dict[int, str] = {}
    for r, (request_id, _, start, end, want_logprobs, topk) in enumerate(batch.request_batch_slices):
        options = batch.request_options[r] if r < len(batch.request_options) else types.SampleOptions()
        try:
            if not 0 <= start < end <= len(batch.all_prompts):
                raise ValueError(f"request has no samples (slice [{start}, {end}))")
            if end - start > limits.max_num_samples:
                raise ValueError(f"num_samples = {end - start} exceeds max_num_samples={limits.max_num_samples}")
            if topk < 0:
                raise ValueError(f"topk_prompt_logprobs = {topk} must be >= 0")
            cap = min(limits.max_topk_prompt_logprobs, limits.vocab)
            if topk > cap:
                raise ValueError(f"topk_prompt_logprobs = {topk} exceeds this server's limit of {cap}")
            request_rows = []
            targets = None
            for i in range(start, end):
                prompt = np.asarray(batch.all_prompts[i], np.int64)
                if prompt.size == 0:
                    raise ValueError("empty prompt")
                bad = np.flatnonzero((prompt < 0) | (prompt >= limits.vocab))
                if bad.size:
                    raise ValueError(f"prompt[{bad[0]}] = {prompt[bad[0]]} is outside the vocabulary [0, {limits.vocab})")
                params = batch.all_sampling_params[i]
                max_tokens = _check_params(params, prompt.size, limits)
                if i == start:  # every row of a request has its prompt
                    targets = check_options(options, prompt.size, want_logprobs, limits)
                adapter = adapter_of(batch.all_model_ids[i], batch.all_checkpoint_paths[i])
                seed = params.seed if params.seed is not None else zlib.crc32(request_id.encode())
                stop = stop_list(params.stop, limits.eos_ids)
                request_rows.append(
                    SampleRow(
                        request_index=r,
                        prompt=prompt.astype(np.int32),
                        adapter=adapter,
                        max_tokens=max_tokens,
                        temperature=params.temperature,
                        top_k=effective_top_k(params.top_k, limits.vocab),
                        top_p=params.top_p,
                        min_p=params.min_p,
                        repetition_penalty=params.repetition_penalty,
                        seed=(seed + i - start) % 2**32,
                        stop_tokens=[s for s in stop if isinstance(s, int)],
                        stop_strings=[s for s in stop if isinstance(s, str)],
                        options=options,
                        targets=targets,
                        tenant=batch.request_tenants[r] if r < len(batch.request_tenants) else "",
                    )
                )
        except (KeyError, ValueError, FileNotFoundError) as e:
            errors[r] = str(e.args[0]) if e.args else str(e)
            continue
        except Exception as e:  # noqa: BLE001 - whatever went wrong, it fails this request only
            logger.exception("sampling request %s failed validation", request_id)
            errors[r] = f"{type(e).__name__}: {e}"
            continue
        rows.extend(request_rows)
    return rows, errors


def truncate_at_stop_string(tokens: list[int], stops: list[str], decode: Callable[[list[int]], str]) -> int | None:
    """Length of the shortest prefix of `tokens` whose text contains a stop string (the stop is included),
    or None. Binary search on prefix length: containment is monotone in the prefix."""
    if not stops or not any(s in decode(tokens) for s in stops):
        return None
    lo, hi = 1, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(tokens[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo
