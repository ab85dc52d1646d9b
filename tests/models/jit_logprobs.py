"""The model's per-token target log-probs as one jitted call: the tests' way to run a loaded model (no torch here,
so the newest-JAX stage of CI, which installs none, can import it)."""

from flax import nnx


@nnx.jit(static_argnames="chunk_size")
def logprobs(model, ids, mask, adapters, targets, chunk_size=16):
    hidden = model(ids, mask, adapters)
    return model.target_logprobs(hidden, targets, adapters, chunk_size=chunk_size)
