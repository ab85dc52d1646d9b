"""tx: post-train LLMs with many LoRA adapters at once, on JAX.

Public names: `tx.AbstractBackend`, `tx.JaxBackend`, `tx.JaxBackendConfig`, `tx.types`, `tx.losses`.
"""

from tx import losses, types
from tx.backends.base import AbstractBackend
from tx.backends.config import JaxBackendConfig
from tx.backends.jax import JaxBackend

__version__ = "0.1.0"
__all__ = ["AbstractBackend", "JaxBackend", "JaxBackendConfig", "losses", "types", "__version__"]
