"""FullBackend: full fine-tuning, one model at a time training every base weight (`training_mode="full"`).

It is JaxBackend with the full-weights training state (tx/backends/full_state.py, chosen by its
`training_mode`): it overrides nothing (tests/backends/test_contract.py checks), and adds the full state's
inspection methods under the names callers use. `backend_class` picks the class a config's training_mode needs.
"""

from __future__ import annotations

from flax import nnx

from tx.backends.config import JaxBackendConfig, MixedPrecisionConfig
from tx.backends.full_state import FullWeightsState
from tx.backends.jax import JaxBackend


class FullBackend(JaxBackend):
    """The backend contract for full fine-tuning of one model at a time (see tx/backends/full_state.py)."""

    training_mode = "full"
    state: FullWeightsState

    @property
    def precision(self) -> MixedPrecisionConfig:
        """The precision policy the model trains with (`config.mixed_precision`, defaults filled in)."""
        return self.state.precision

    def master_weights(self, model_id: str) -> nnx.State:
        """The optimizer's float32 weights: the masters (bf16 params) or the model's own weights (fp32)."""
        return self.state.master_weights(model_id)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the training state on this process's first device, per kind (params, masters, sums, adam)."""
        return self.state.state_bytes()


def backend_class(config: JaxBackendConfig) -> type[JaxBackend]:
    """The backend class that serves `config.training_mode`."""
    return FullBackend if config.training_mode == "full" else JaxBackend
