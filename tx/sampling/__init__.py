"""Sampling: the KV-cache decode loop, per-row sampling parameters as device arrays, stop handling."""
