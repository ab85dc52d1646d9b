"""tx: post-train LLMs with many LoRA adapters at once, on JAX.

Public names: `tx.AbstractBackend`, `tx.JaxBackend`, `tx.FullBackend` (training_mode="full"), `tx.JaxBackendConfig`,
`tx.types`, `tx.losses`.
"""

import logging

# transformers logs "PyTorch was not found..." when it is imported without torch; tx needs only its
# tokenizers and configs, so on every tx start that line was noise (a filter, not a global verbosity:
# transformers' real warnings still show).
logging.getLogger("transformers").addFilter(lambda record: "PyTorch was not found" not in record.getMessage())

from tx import losses, types  # noqa: E402
from tx.backends.base import AbstractBackend  # noqa: E402
from tx.backends.config import JaxBackendConfig  # noqa: E402
from tx.backends.jax import JaxBackend  # noqa: E402
from tx.backends.full import FullBackend  # noqa: E402
from tx.version import __version__  # noqa: E402

__all__ = ["AbstractBackend", "FullBackend", "JaxBackend", "JaxBackendConfig", "losses", "types", "__version__"]
