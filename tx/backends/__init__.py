"""Backends: the seed's AbstractBackend contract and its single-program JAX implementation."""
