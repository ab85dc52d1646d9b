"""The model-family interface: what the rest of tx (backends, the sampling engine, checkpoints, loading) uses of a
model, so a family registered with `tx.models.registry.register` knows what to provide.

A family is (1) a `ModelConfig` mapping from its HF `config.json` (`tx.models.config`: the model_type's defaults
and fields), (2) a model class satisfying `CausalLM` below, built from `(config, LoraSlots, dtype=...,
remat_policy=..., attention_impl=..., moe_impl=..., experts_whole=..., platform=..., sharding=..., rngs=...)`.
Its nnx paths are its contract with the rest:
- checkpoint names: a base parameter at `stacks/<s>/layer/<module path>/<leaf>` is the HF tensor
  `model.layers.<i>.<module path>.weight` (`kernel`: transposed from HF's `[out, in]`; other leaves keep their name,
  e.g. `e_score_correction_bias`) for each layer `i` of the stack; `embed_tokens`, `norm`, `lm_head` as HF's
  (`tx.models.loading.hf_source`, `tx.checkpoints.full.hf_layout`);
- LoRA targets and their HF/PEFT names: every module with `LoraA` / `LoraB` / `LoraScale` variables (`lora_a [A,
  in, R]`, `lora_b [A, R, out]`, experts with a leading axis), named by the same rule (`tx.models.adapters`);
  modules under `self_attn` are the Tinker `train_attn` group, the LM head `train_unembed`, the rest `train_mlp`;
- sharding: each LoRA-carrying linear's module name has its logical (in, out) axes in
  `tx.models.logical.LINEAR_AXES`, other variables in `tx.models.sharding.OTHER_AXES`;
- the paged cache: `kv_layout()` (the pools the engine allocates per stack) and `paged_forward`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from tx.models.config import LoraSlots, ModelConfig
from tx.models.logical import LogicalSharding


@runtime_checkable
class CausalLM(Protocol):
    config: ModelConfig
    slots: LoraSlots
    layout: LogicalSharding  # the logical-axis rules on the mesh its activations and caches follow
    platform: str  # what its programs are built for ("cpu", "cuda", "tpu")
    stacks: Any  # scanned layer stacks, each with `layer_ids`, `layer` and `scanned_state()`
    embed_tokens: Any  # `embedding [vocab, d]`: its dtype is the model's

    def __call__(self, input_ids_bt: jax.Array, attention_mask_bt: jax.Array, adapter_indices_b: jax.Array | None = None,
                 positions_bt: jax.Array | None = None, segment_ids_bt: jax.Array | None = None) -> jax.Array:
        """Final hidden states `[b, t, d]` (training, scoring)."""
        ...

    def paged_forward(self, ids_bt: jax.Array, positions_bt: jax.Array, valid_bt: jax.Array,
                      adapter_indices_b: jax.Array | None, pools: list[tuple[jax.Array, ...]], table_bw: jax.Array,
                      impl: str = "blocked", kv_block: int = 128, kv_blocks: int | None = None,
                      layers: list | None = None, prefix: Any = None, last_at_r: jax.Array | None = None
                      ) -> tuple[jax.Array, list[tuple[jax.Array, ...]]]:
        """The sampling engine's step: hidden states (`[b, t, d]`, or with `last_at_r` those of token
        `last_at_r[i]` of each row, `[b, 1, d]`), and the page pools with this call's entries written (`prefix`: a
        decode call's `tx.kernels.shared_prefix.SharedPrefix`, or None)."""
        ...

    def kv_layout(self) -> tuple[tuple[tuple[int, ...], tuple[str | None, ...]], ...]:
        """Per page pool of a stack: its per-token, per-layer entry shape and logical axes."""
        ...

    def kv_bytes_per_token(self) -> int: ...

    def logits(self, h_btd: jax.Array, adapter_indices_b: jax.Array | None) -> jax.Array: ...

    def target_logprobs(self, hidden_btd: jax.Array, targets_bt: jax.Array, adapter_indices_b: jax.Array | None = None,
                        chunk_size: int = 1024, with_entropy: bool = False,
                        temperature_b: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]: ...

    def values(self, hidden_btd: jax.Array, adapter_indices_b: jax.Array) -> jax.Array: ...

    def head_lora_scale(self) -> jax.Array: ...

    def scanned_states(self) -> list: ...

    def layer_bytes(self) -> int: ...
