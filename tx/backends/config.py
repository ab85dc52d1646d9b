"""JaxBackendConfig: every knob of the JAX backend, validated."""

from __future__ import annotations

import json
import logging
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from tx.log import warn_once
from tx.models.logical import DEFAULT_RULES, LOGICAL_AXES, MESH_AXES, check_rules
from tx.models.sharding import AUTO, MESH_FIELDS, MeshShape, resolve_mesh_shape

logger = logging.getLogger(__name__)

# 16k padded tokens per call: the issue asks one 16,384-token row to train in <= 6 GB (blockwise attention,
# remat), so a call of this size fits wherever that row fits, while [rows, t] matmuls of 16k tokens already
# keep an accelerator busy: bigger calls would gain little speed and risk memory.
DEFAULT_MICRO_BATCH_TOKENS = 16384


def _mesh_size(value):
    """'auto' (a flag's or JSON's spelling) is -1; a mesh size is >= 1 or -1."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO
    return value


def _check_mesh_size(value: int) -> int:
    if value < 1 and value != AUTO:
        raise ValueError(f"{value} is not a mesh size: >= 1, or -1 / 'auto' (the devices the other axes leave)")
    return value


# A mesh axis size: >= 1, or -1 / "auto" (see tx.models.sharding.resolve_mesh_shape)
MeshSize = Annotated[int, BeforeValidator(_mesh_size), AfterValidator(_check_mesh_size)]

# The logical-axis rules table (tx.models.logical): checked names, kept as a tuple of pairs
LogicalRules = Annotated[tuple[tuple[str, str | None], ...], AfterValidator(check_rules)]

# training_mode="full" trains the base weights; the model still carries LoRA slots (read by slot 0, zero), the
# smallest it allows: these values, whatever max_lora_adapters / max_lora_rank say (a value given is logged)
FULL_MODE_LORA_SLOTS = {"max_lora_adapters": 2, "max_lora_rank": 1}

# Fields earlier versions had: (the value that asks for what runs now, and is accepted; why any other value is
# refused). extra="forbid" alone would only say "extra inputs are not permitted".
REMOVED_FIELDS = {
    "sample_engine": ("paged", "the static sampling engine was removed and the paged engine is the only one"),
    "sample_max_num_sequences": (0, "it sized the calls of the removed static sampling engine (the paged engine's "
                                 "rows decoding at once: max_num_seqs)"),
}


class MixedPrecisionConfig(BaseModel):
    """Full training's precision policy, with the seed's MixedPrecisionConfig names and values."""

    model_config = ConfigDict(extra="forbid")

    param_dtype: Literal["bf16", "fp32"] = Field(
        "bf16", description="dtype the model computes (forward, backward, sampling) in; with 'bf16' the optimizer "
        "keeps float32 master weights and writes a bf16 copy into the model after each step"
    )
    reduce_dtype: Literal["fp32"] = Field("fp32", description="dtype of the gradient sums (across micro-batches "
                                          "and forward_backward calls)")
    buffer_dtype: Literal["fp32"] = Field("fp32", description="accepted for the seed's configs: RMSNorm statistics "
                                          "and log-probs are always float32 here")


class JaxBackendConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_lora_adapters: int = Field(16, ge=2, description="adapter slots including slot 0 (the base model)")
    max_lora_rank: int = Field(32, ge=1, description="largest LoRA rank; every slot is allocated at this rank")
    tensor_parallel_size: MeshSize = Field(1, description="mesh size of the 'tp' axis (-1 or 'auto': the devices "
                                           "the other axes leave)")
    expert_parallel_size: MeshSize = Field(1, description="mesh size of the 'ep' axis (-1 or 'auto': the devices "
                                           "the other axes leave)")
    fully_sharded_data_parallel_size: MeshSize = Field(
        AUTO, description="mesh size of the 'fsdp' axis; -1 or 'auto' (default): the devices the other axes leave, "
        "so the mesh spans every device of the run (every local device, or every device of every process). At "
        "most one size is -1; the sizes must divide the device count")
    train_micro_batch_tokens: int = Field(
        DEFAULT_MICRO_BATCH_TOKENS, ge=0, description="padded tokens (rows x bucketed length) per jit call of "
        "forward/forward_backward: the rows of a round, all tenants, are sorted by length and packed into "
        "micro-batches under this budget, each padded to its own length; a longer row runs alone "
        "(0 = no budget: one call per train_micro_batch_size rows)"
    )
    train_micro_batch_size: int = Field(
        0, ge=0, description="at most this many rows per jit call in forward/forward_backward (0 = no row cap)"
    )
    kv_page_size: int = Field(16, ge=1, description="paged engine: tokens per KV page")
    kv_cache_pages: int = Field(0, ge=0, description="paged engine: KV pages in the pool (0 = every decode slot "
                                "at max_seq_len plus one longest prompt and row, capped at half of the device "
                                "memory free at start, or a quarter of the host's memory on CPU)")
    max_num_seqs: int = Field(64, ge=1, description="paged engine: decode slots (rows decoding at once)")
    prefill_chunk: int = Field(64, ge=1, description="paged engine: prompt tokens per prefill chunk")
    prefill_rows: int = Field(64, ge=1, description="paged engine: most prefill chunks per device call (a call "
                              "takes what the admitted prompts need, in powers of 2; the decoding rows wait for it, "
                              "so lower it where prefill is slow, e.g. on CPU with a large model)")
    decode_steps_per_call: int = Field(8, ge=1, description="paged engine: decode steps per device call while "
                                       "requests wait to join (rows join and leave between calls)")
    max_decode_steps_per_call: int = Field(64, ge=1, description="paged engine: decode steps per device call when "
                                           "no request waits (one on-device loop that ends early once every row has "
                                           "stopped, and sooner where enough rows reach their max_tokens that the rest "
                                           "fit a smaller slot count; the bound is traced, so both sizes share one program)")
    paged_async_dispatch: bool = Field(True, description="paged engine: while no request waits to join (or every "
                                       "slot holds a row that runs on and a prefilled request waits), dispatch "
                                       "the next decode call from the device's own slot state (tokens, positions, "
                                       "stops) before reading the current call's results, so the device does not "
                                       "wait for the host between calls; a row the host ends on a stop string runs "
                                       "on in the call already dispatched (its tokens there are dropped), and a "
                                       "request arriving waits for that call too, so calls with nothing waiting run "
                                       "half of max_decode_steps_per_call (a request's wait stays within one such "
                                       "call). False: every decode call waits for the host to read the one before")
    paged_attention_impl: Literal["blocked", "reference", "pallas"] = Field(
        "blocked", description="paged engine: attention over pages ('blocked': XLA online softmax over KV blocks; "
        "'reference' gathers every page: the oracle; 'pallas': the ragged paged attention Pallas kernel, for TPU, "
        "interpreted (slow) elsewhere)")
    paged_kv_blocks: Literal["auto", "dynamic", "bucketed"] = Field(
        "auto", description="paged engine, 'blocked' attention: how many KV blocks a decode call's attention "
        "loops over. 'dynamic': what the longest row needs, found on the device (a data-dependent loop, which XLA "
        "runs on a GPU by waiting for the host at every block of every layer of every step); 'bucketed': what the "
        "longest row reaches by the call's end, chosen by the host and rounded up to a power of two (a loop of "
        "known count; one decode program per bucket; up to 2x the KV reads); 'auto': bucketed on GPUs, dynamic "
        "elsewhere. Prefill calls always find the count on the device")
    paged_shared_prefix: bool = Field(
        True, description="paged engine, 'blocked' attention with the block count found on the device: decode "
        "calls of 2+ slots gather the pages several rows share (the samples of one prompt, prompts the prefix "
        "cache shares) once per segment of up to 4 such rows instead of once per row, then each row its own "
        "pages. Each row's products and softmax are the row-by-row read's own, so its results are the same bits "
        "on or off (CPU, RL calls of 16 samples a prompt: 1.08x with 128-token prompts, 1.30x with "
        "512; level where nothing is shared). False: every row gathers its whole table itself")
    decode_slot_counts: Literal["auto", "pow2", "three_quarters", "eighths"] = Field(
        "auto", description="paged engine: the slot counts a decode call runs on (its live rows rounded up; every "
        "slot costs its compute until the call returns). 'pow2': powers of 2; 'three_quarters': also 3/4 of a "
        "power of 2 above 64 (96, 192, 384: less padding as a batch shrinks, one more decode program per "
        "octave); 'eighths': also 5/8, 6/8 and 7/8 of one above 64 (80, 96, 112, 160, ..., 448: three more "
        "programs per octave; at the default max_num_seqs of 64 all three give powers of 2); 'auto': eighths on "
        "CPU, where decode is compute-bound (RL sampling, 512 rows: three_quarters 1.2x pow2's tokens/s, eighths "
        "with CPU's attention row groups 1.12x three_quarters'), pow2 on accelerators, where a decode step at "
        "these batches mostly reads weights")
    paged_decode_layers: Literal["auto", "scan", "unrolled"] = Field(
        "auto", description="paged engine: how a decode call runs the layers. 'scan': `lax.scan` over the "
        "stacked weights, which slices every layer's weights out of the stack at every step (a copy per weight "
        "on CPU, and on GPU where the matmul cannot read the slice in place); 'unrolled': the layers run one by "
        "one on per-layer copies of their weights, made at the first decode call and kept (memory: one more "
        "copy of the layer weights, held while the engine lives; an adapter's copies are remade after its "
        "weights change) (a longer compile); 'auto': unrolled on one CPU or NVIDIA GPU device when that copy "
        "takes at most a quarter of the free memory (H100, Qwen3-1.7B shape: 1.3x decode tokens/s at batch 1, "
        "1.7x at 64), else scan (TPUs read a scanned slice in place; over several devices the scan gathers "
        "each layer's weights in turn)")
    prefix_cache: bool = Field(True, description="paged engine: reuse the KV pages of prompt prefixes seen "
                               "before with the same weights (full pages, least recently used evicted first)")
    kv_block: int | None = Field(
        None, ge=1, description="paged engine: tokens per attention block (a multiple of kv_page_size). None: "
        "32 on CPU (decode at 8-256 rows 1.03-1.14x faster than 64 there: less of the last block masked), 64 "
        "elsewhere, rounded up to a multiple of kv_page_size. Prefill calls with 'blocked' attention on CPU use "
        "blocks of at least 128 tokens (a chunk's queries meet fewer, larger blocks)")
    max_num_samples: int = Field(128, ge=1, description="largest num_samples one sampling request may ask for")
    default_max_tokens: int = Field(
        1024, ge=0, description="new tokens of a sample request that sends max_tokens=None (the SDK default), "
        "capped by the room left in the context; 0 = all of that room (each row's KV cache then spans the "
        "whole context)"
    )
    max_topk_prompt_logprobs: int = Field(20, ge=0, description="largest topk_prompt_logprobs a request may ask for "
                                          "(also bounds topk_sample_logprobs and prompt_alt_tokens_k)")
    max_target_prompt_logprobs: int = Field(64, ge=1, description="most token ids target_prompt_logprobs may name "
                                            "at one prompt position")
    max_snapshots_per_model: int = Field(
        4, ge=1, description="in-memory sampler snapshots (save_weights_and_get_sampling_client) kept per "
        "model; the oldest is evicted beyond this"
    )
    max_seq_len: int | None = Field(
        None, ge=1, description="longest accepted sequence (default: the model's max_position_embeddings)"
    )
    enforce_eager: bool = Field(False, description="run without jit (debugging)")
    shard_attention_heads: bool = Field(True, description="shard attention heads over 'tp' when they divide")
    logical_axis_rules: LogicalRules = Field(
        DEFAULT_RULES,
        description="[logical axis, mesh axis or null] pairs: how parameters and activations that name their axes "
        f"({', '.join(LOGICAL_AXES)}) are laid out over the mesh ({', '.join(MESH_AXES)}); for each dimension "
        "the first rule of its name whose mesh axis the tensor has not used yet wins; unlisted names are replicated"
    )
    gradient_checkpointing: bool = Field(
        True, description="recompute each layer in the backward pass (what it keeps: remat_policy); off, no "
        "weight matmul is recomputed (a dense layer keeps their outputs and recomputes the elementwise ops, "
        "LoRA products and attention between them: faster and less memory than keeping everything)"
    )
    remat_policy: Literal["layer", "dots_saveable", "dots_with_no_batch_dims_saveable"] = Field(
        "layer", description="with gradient_checkpointing, what each layer keeps for the backward pass: 'layer' "
        "only its input (least memory), 'dots_saveable' every matmul output (faster, more memory)"
    )
    moe_impl: Literal["auto", "ragged_dot", "blocked", "megablox"] = Field(
        "auto", description="MoE grouped matmul: 'auto' picks megablox on TPU, ragged_dot on GPU, blocked elsewhere "
        "(CPU: cost follows the routed tokens, not the expert count)"
    )
    attention_impl: Literal["auto", "blockwise", "cudnn", "splash", "reference"] = Field(
        "auto", description="attention kernel: 'auto' picks splash on TPU, cuDNN on GPU, blockwise elsewhere; "
        "'reference' is the dense O(t^2)-memory oracle"
    )
    loss_chunk_size: int = Field(1024, ge=1, description="tokens per chunk of the log-prob computation")
    dtype: Literal["float32", "bfloat16"] | None = Field(None, description="base weight dtype (default: checkpoint's)")
    training_mode: Literal["lora", "full"] = Field(
        "lora", description="'lora': many tenants' adapters over frozen base weights (JaxBackend); 'full': one model "
        "at a time trains every base weight (tx.backends.full.FullBackend)"
    )
    mixed_precision: MixedPrecisionConfig | None = Field(
        None, description="training_mode='full' only: parameter and gradient-sum dtypes (default: the seed's, bf16 "
        "params with float32 masters and float32 gradient sums)"
    )
    coordinator_address: str | None = Field(None, description="host:port of process 0 (multi-host)")
    num_processes: int | None = Field(None, ge=1, description="number of processes (multi-host)")

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, values):
        if isinstance(values, dict):
            for name, (current, why) in REMOVED_FIELDS.items():
                if name in values and values[name] != current:
                    raise ValueError(f"{name}={values[name]!r} is no longer a setting: {why}")
            values = {k: v for k, v in values.items() if k not in REMOVED_FIELDS}
        return values

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _param_dtype_shorthand(cls, value):
        """`--mixed-precision fp32` (a flag's string) means {"param_dtype": "fp32"}; a JSON object string too."""
        if isinstance(value, str):
            return json.loads(value) if value.lstrip().startswith("{") else {"param_dtype": value}
        return value

    @model_validator(mode="after")
    def _full_mode_fields(self) -> JaxBackendConfig:
        if self.training_mode == "lora" and self.mixed_precision is not None:
            raise ValueError("mixed_precision applies to training_mode='full' only (training_mode='lora')")
        if self.training_mode == "full" and self.dtype is not None:
            raise ValueError(f"dtype={self.dtype!r}: with training_mode='full' the parameter dtype is "
                             "mixed_precision.param_dtype")
        if self.kv_block is not None and self.kv_block % self.kv_page_size:
            raise ValueError(f"kv_block={self.kv_block} must be a multiple of kv_page_size={self.kv_page_size}")
        if self.paged_kv_blocks == "bucketed" and self.paged_attention_impl != "blocked":
            raise ValueError(f"paged_kv_blocks='bucketed' applies to paged_attention_impl='blocked' only "
                             f"(paged_attention_impl={self.paged_attention_impl!r})")
        if sum(getattr(self, name) == AUTO for name in MESH_FIELDS.values()) > 1:
            resolve_mesh_shape(*self.mesh_sizes(), num_devices=1)  # raises, naming the -1 fields
        if self.training_mode == "full":
            for name, used in full_mode_lora_slots(self).items():
                setattr(self, name, used)  # the config says what runs (also on the workers it is sent to)
        return self

    def mesh_sizes(self) -> tuple[int, int, int]:
        """(fsdp, ep, tp) as given, -1 = auto."""
        return (self.fully_sharded_data_parallel_size, self.expert_parallel_size, self.tensor_parallel_size)

    def mesh_shape(self, num_devices: int, num_processes: int = 1) -> MeshShape:
        """The mesh these sizes give over the run's `num_devices` devices (see `resolve_mesh_shape`)."""
        return resolve_mesh_shape(*self.mesh_sizes(), num_devices=num_devices, num_processes=num_processes)


def full_mode_lora_slots(config: JaxBackendConfig) -> dict[str, int]:
    """The `FULL_MODE_LORA_SLOTS` values that differ from `config`'s; each one the user gave (`model_fields_set`)
    is logged once, naming what runs instead (it is not refused: one command line may serve both modes)."""
    changes = {}
    for name, used in FULL_MODE_LORA_SLOTS.items():
        value = getattr(config, name)
        if value != used:
            if name in config.model_fields_set:
                warn_once(("full_mode", name, value), f"{name}={value} is not used with training_mode='full' (no "
                          f"LoRA adapters: every base weight trains); it runs with {name}={used}", logger=logger)
            changes[name] = used
    return changes
