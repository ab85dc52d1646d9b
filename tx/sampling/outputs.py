"""Host-side assembly of a request's answer from the engine's rows and the prompt scores (tinker 0.38 SampleResponse fields).

Prompt lists have one entry per prompt token, None at position 0 (no context). `prompt_logprobs_last_n`
(SampleRequest docstring: "prompt_logprobs[-N:] are scored and earlier entries are None ... also applies to
topk_prompt_logprobs"; "does not affect target_prompt_logprobs or prompt_alt_tokens_k") leaves None before
the last N positions of both lists. Sampled top-k rows are cut with their tokens at a stop string.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tx import types
from tx.sampling.paged_rows import RowResult
from tx.sampling.prompt_scores import PromptScores
from tx.sampling.requests import SampleRow, truncate_at_stop_string
from tx.sampling.targets import answer


def _pairs(ids_nk: np.ndarray, logprobs_nk: np.ndarray) -> list[list[tuple[int, float]]]:
    return [list(zip(map(int, ids), map(float, lps))) for ids, lps in zip(ids_nk, logprobs_nk)]


def sequence_of(res: RowResult, row: SampleRow, decode_text: Callable[[list[int]], str]
                ) -> types.GeneratedSequence:
    """A finished row of the engine as the sequence `row` asked for (cut at its first stop string)."""
    n = len(res.tokens)
    tokens, logprobs = list(res.tokens), list(res.logprobs)
    reason = "stop" if res.stopped else "length"
    cut = truncate_at_stop_string(tokens, row.stop_strings, decode_text)
    if cut is not None:
        tokens, logprobs, reason, n = tokens[:cut], logprobs[:cut], "stop", cut
    topk = None
    if k := row.options.topk_sample_logprobs:
        topk = [list(zip(map(int, ids[:k]), map(float, lps[:k])))
                for ids, lps in zip(res.top_ids[:n], res.top_logprobs[:n])]
    return types.GeneratedSequence(tokens=tokens, logprobs=logprobs, stop_reason=reason, topk_logprobs=topk)


def prompt_output(output: types.SampleOutput, scores: PromptScores, i: int, row: SampleRow, want_logprobs: bool,
                  want_topk: int) -> types.SampleOutput:
    """`output` with the prompt fields that `row`'s request asked for, from row `i` of `scores`."""
    n = len(row.prompt)
    last_n = row.options.prompt_logprobs_last_n
    skip = n - 1 - last_n if last_n is not None else 0  # positions 1..skip are left None
    if want_logprobs:
        output.prompt_logprobs = [None] * (1 + skip) + [float(x) for x in scores.next_bt[i, skip : n - 1]]
    if want_topk:
        top = _pairs(scores.top_ids_btk[i, skip : n - 1, :want_topk], scores.top_logprobs_btk[i, skip : n - 1, :want_topk])
        output.topk_prompt_logprobs = [None] * (1 + skip) + top
    if row.targets is not None:
        width = row.targets.width
        output.target_prompt_logprobs = answer(row.options.target_prompt_logprobs, row.targets,
                                               scores.target_btm[i, : n - 1, :width])
    if k := row.options.prompt_alt_tokens_k:
        output.prompt_alt_tokens = _pairs(scores.alt_ids_bta[i, : n - 1, :k], scores.alt_logprobs_bta[i, : n - 1, :k])
    return output
