"""Backends: the contract (base.py: the seed's AbstractBackend, and the Backend / LocalBackend Protocols tx's
callers rely on) and its single-program JAX implementation, one class (jax.py) composed with a training
state: LoRA slots (lora_state.py) or full weights (full_state.py)."""
