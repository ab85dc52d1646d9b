"""Qwen3 building blocks as flax nnx modules. Every module takes a `stack` shape of leading axes (the
layers of a scanned decoder stack) so that one module instance holds all layers' weights."""
