"""Sampling: the paged engine (paged KV cache, continuous batching), per-row sampling parameters as device
arrays, stop handling, prompt scores."""
