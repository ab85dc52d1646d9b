"""What the sampling package needs from whoever holds the weights (a backend), as protocols: the engine
imports nothing from `tx.backends`; the backends satisfy these (tests/sampling/test_source.py checks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable


class SamplingSettings(Protocol):
    """The configuration fields the sampler and the paged engine read (`JaxBackendConfig` has them all;
    their meaning is in its field descriptions)."""

    max_num_samples: int
    default_max_tokens: int
    max_topk_prompt_logprobs: int
    max_target_prompt_logprobs: int
    loss_chunk_size: int
    max_num_seqs: int
    kv_page_size: int
    kv_cache_pages: int
    kv_block: int | None
    prefill_chunk: int
    prefill_rows: int
    prefix_cache: bool
    decode_steps_per_call: int
    max_decode_steps_per_call: int
    paged_attention_impl: str
    paged_kv_blocks: str
    paged_shared_prefix: bool
    paged_decode_layers: str
    decode_slot_counts: str
    paged_async_dispatch: bool


@runtime_checkable
class WeightsSource(Protocol):
    """The model being sampled and how a request's weights map to one of its adapter slots."""

    model: Any  # the nnx model (tx.models), every adapter slot's LoRA weights stacked in it
    model_dir: Path  # its tokenizer and generation config
    max_seq_len: int

    def sample_slot(self, model_id: str) -> int:
        """The slot rows of live model `model_id` read ("" = the base model); raises for an unknown id."""

    def sampler_slot(self, path: str, pinned: set[int]) -> int:
        """The slot holding sampler checkpoint `path` (loaded into a spare slot if needed, never one of
        `pinned`); raises KeyError / ValueError / FileNotFoundError naming what is wrong."""

    def kv_identity(self, slot: int, tenant: str = "") -> str | None:
        """The prefix-cache key of the weights `slot` holds now (rows with equal keys may share KV pages;
        None: share with nobody)."""
