"""Attention kernels behind one dispatch.

`attention(q, k, v, mask_bts, scale)` is the dense reference: the full float32 `[b, kv, g, t, s]` score
tensor under an explicit boolean mask. The paged engine's "reference" kernel uses it over the gathered pages
(`tx.kernels.paged_attention`), and it is the tests' oracle.

Training and scoring call `self_attention(q, k, v, segment_ids_bt, scale, impl)`: causal self-attention
where key j is visible to query i iff j <= i and seg[i] == seg[j], with `segment_ids_bt` int32 and
padding = -1 (`segment_ids_for_attention` builds it from an attention mask and packing segment ids). A
padding query sees only padding keys (itself at least), so every row has a key and nothing is NaN; its
output is finite garbage that callers ignore. `impl` names a kernel in `SELF_ATTENTION_IMPLS`; "auto"
picks one by platform (`AUTO_IMPL`).

The platform is explicit (`tx.kernels.platform`: "cpu", "cuda", "rocm" or "tpu"), never read from
`jax.default_backend()` while tracing: the model resolves it once when built (its mesh's devices) and passes
it down in `SelfAttentionMask.platform` (static), so a program built for "tpu" lowers the splash kernel
(compiled, a Mosaic custom call) also when exported from a CPU host, and one built for "cuda" picks cuDNN.
The kernel functions' `platform=None` (JAX's first device) is for direct callers that build no model.

No silent fallbacks: "auto" quietly runs whatever fits, but an explicit `attention_impl='cudnn'` that cannot
run logs once per reason (`tx.log.warn_once`) `attention_impl='cudnn' cannot run <reason>; running
'blockwise' instead` -- off GPU and float32 inputs here, at trace time; packed rows (several segment ids in a
row) are decided per batch on device and announced by the backend, which sees the rows on the host
(`warn_cudnn_packed`): no host callback in the compiled program -- and refuses a head size cuDNN never takes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp

from tx.kernels.flash import blockwise_attention
from tx.kernels.platform import normalise, resolve
from tx.kernels.splash import splash_attention
from tx.log import warn_once

logger = logging.getLogger(__name__)

_MASKED = -1e30


def causal_mask(attention_mask_bt: jax.Array, segment_ids_bt: jax.Array | None = None) -> jax.Array:
    """bool [b, t, s]: query t sees key s if s <= t, key s is not padding, and (packing) same segment."""
    t = attention_mask_bt.shape[1]
    causal_ts = jnp.tril(jnp.ones((t, t), dtype=bool))
    mask_bts = causal_ts[None] & attention_mask_bt.astype(bool)[:, None, :]
    if segment_ids_bt is not None:
        mask_bts &= segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    return mask_bts


def attention(
    q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, mask_bts: jax.Array, scale: float
) -> jax.Array:
    """softmax(q k^T * scale + mask) v with h query heads sharing k kv heads; returns [b, t, h, d].

    Scores, softmax and the mask are float32 whatever the input dtype. Masked positions get a large finite
    negative score, so a row with no visible key yields finite garbage, never NaN."""
    b, t, h, d = q_bthd.shape
    kv_heads = k_bskd.shape[2]
    q_btkgd = q_bthd.reshape(b, t, kv_heads, h // kv_heads, d)
    scores_bkgts = jnp.einsum("btkgd,bskd->bkgts", q_btkgd, k_bskd, preferred_element_type=jnp.float32)
    scores_bkgts = jnp.where(mask_bts[:, None, None], scores_bkgts * scale, _MASKED)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1)
    out_btkgd = jnp.einsum(
        "bkgts,bskd->btkgd", probs_bkgts.astype(v_bskd.dtype), v_bskd, preferred_element_type=jnp.float32
    )
    return out_btkgd.reshape(b, t, h, d).astype(q_bthd.dtype)


def segment_ids_for_attention(attention_mask_bt: jax.Array, segment_ids_bt: jax.Array | None = None) -> jax.Array:
    """int32 [b, t]: the packing segment id (0 when not packed) of each real token, -1 on padding."""
    seg = jnp.zeros(attention_mask_bt.shape, jnp.int32) if segment_ids_bt is None else segment_ids_bt
    return jnp.where(attention_mask_bt.astype(bool), seg.astype(jnp.int32), -1)


def visibility_mask(segment_ids_bt: jax.Array) -> jax.Array:
    """bool [b, t, t] of the self-attention rule: j <= i and seg[i] == seg[j]."""
    t = segment_ids_bt.shape[1]
    same_bts = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    return jnp.tril(jnp.ones((t, t), dtype=bool))[None] & same_bts


def reference_self_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt, scale: float) -> jax.Array:
    return attention(q_bthd, k_btkd, v_btkd, visibility_mask(segment_ids_bt), scale)


def _on_gpu(platform: str) -> bool:
    """Whether cuDNN can run on `platform` (normalised)."""
    return platform == "cuda"


_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def _cudnn_fallback(reason_key: str, reason: str) -> None:
    warn_once(("attention_impl", "cudnn", reason_key),
              f"attention_impl='cudnn' cannot run {reason}; running 'blockwise' instead", logger=logger)


def _cudnn_takes(segment_ids_bt: jax.Array) -> jax.Array:
    """bool scalar: every row is one segment, right-padded (what the sequence-length API expresses)."""
    t = segment_ids_bt.shape[1]
    real_bt = segment_ids_bt >= 0
    lengths_b = real_bt.sum(axis=1).astype(jnp.int32)
    right_padded = jnp.all(real_bt == (jnp.arange(t)[None, :] < lengths_b[:, None]))
    one_segment = jnp.all((segment_ids_bt == segment_ids_bt[:, :1]) | ~real_bt)
    return right_padded & one_segment


def warn_cudnn_packed(platform: str) -> None:
    """For a backend (its programs built for `platform`) whose batch holds packed rows while
    attention_impl='cudnn' was asked for: on GPU those batches run blockwise (off GPU every batch does,
    already said at trace time)."""
    if _on_gpu(normalise(platform)):
        _cudnn_fallback("packed", "a batch with packed rows (several segment ids in a row, as SFT packs) (cuDNN takes one "
                                  "right-padded sequence per row)")


def _cudnn_attention(q_bthd, k_btkd, v_btkd, lengths_b: jax.Array, scale: float) -> jax.Array:
    return jax.nn.dot_product_attention(
        q_bthd, k_btkd, v_btkd, scale=scale, is_causal=True, query_seq_lengths=lengths_b,
        key_value_seq_lengths=lengths_b, implementation="cudnn",
    )


def cudnn_self_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt, scale: float, *, asked: bool = True,
                         platform: str | None = None) -> jax.Array:
    """cuDNN flash attention where the mask is causal + right padding (the public `jax.nn` API takes
    sequence lengths, not segment ids); packed rows, other padding, or dtypes cuDNN does not take run the
    blockwise kernel instead (decided per call at run time for the mask), and so does every call off
    "cuda" (`platform`, default JAX's first device's). `asked`: the user named 'cudnn' (not "auto"): then
    each fallback is logged once, and a head size cuDNN never takes is refused."""
    d = q_bthd.shape[-1]
    platform = resolve(platform)
    if not _on_gpu(platform):
        if asked:
            _cudnn_fallback(f"platform={platform}", f"on {platform} (cuDNN needs a GPU)")
        return blockwise_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt, scale)
    if d % 8 or d > 256:
        if asked:
            raise ValueError(f"attention_impl='cudnn' cannot run head_dim={d}: cuDNN flash attention takes a "
                             "multiple of 8 up to 256; set attention_impl='blockwise' (or 'auto')")
        return blockwise_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt, scale)
    if q_bthd.dtype not in _CUDNN_DTYPES:
        if asked:
            _cudnn_fallback(f"dtype={q_bthd.dtype}", f"{q_bthd.dtype} inputs (cuDNN flash attention takes "
                                                     "bfloat16 or float16)")
        return blockwise_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt, scale)
    lengths_b = (segment_ids_bt >= 0).sum(axis=1).astype(jnp.int32)

    def cudnn(q, k, v):
        return _cudnn_attention(q, k, v, lengths_b, scale)

    def blockwise(q, k, v):
        return blockwise_attention(q, k, v, segment_ids_bt, scale)

    return jax.lax.cond(_cudnn_takes(segment_ids_bt), cudnn, blockwise, q_bthd, k_btkd, v_btkd)


SelfAttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, float], jax.Array]

SELF_ATTENTION_IMPLS: dict[str, SelfAttentionFn] = {
    "reference": reference_self_attention,
    "blockwise": blockwise_attention,
    "cudnn": cudnn_self_attention,
    "splash": splash_attention,
}
# What "auto" means on each (normalised) platform; anything else gets "blockwise".
AUTO_IMPL = {"tpu": "splash", "cuda": "cudnn"}


def resolve_attention_impl(name: str, platform: str | None = None) -> str:
    """The kernel name `name` stands for on `platform` (default: JAX's first device's; "gpu" = "cuda")."""
    if name == "auto":
        return AUTO_IMPL.get(resolve(platform), "blockwise")
    if name not in SELF_ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={name!r} is not one of auto, {', '.join(SELF_ATTENTION_IMPLS)}")
    return name


def self_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt, scale: float, impl: str = "auto",
                   platform: str | None = None) -> jax.Array:
    """Causal segment-masked GQA self-attention [b, t, h, d] with the kernel `impl` built for `platform`
    (default: JAX's first device's; see module doc)."""
    platform = resolve(platform)
    name = resolve_attention_impl(impl, platform)
    if name == "cudnn":  # "auto" on GPU: cuDNN where it fits, blockwise elsewhere, without a word
        return cudnn_self_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt, scale, asked=impl == "cudnn",
                                    platform=platform)
    if name == "splash":
        return splash_attention(q_bthd, k_btkd, v_btkd, segment_ids_bt, scale, platform=platform)
    return SELF_ATTENTION_IMPLS[name](q_bthd, k_btkd, v_btkd, segment_ids_bt, scale)


@dataclasses.dataclass(frozen=True)
class SelfAttentionMask:
    """What a training/scoring layer needs to attend: the segment ids (a traced array), the kernel name and
    the platform the program is built for (both static). The sampling engine's layers attend over their KV
    pages instead (`tx.kernels.paged_attention`)."""

    segment_ids_bt: jax.Array
    impl: str = "auto"  # as asked ("auto" stays "auto": `self_attention` resolves it and stays quiet)
    platform: str | None = None  # normalised; None: JAX's first device's


jax.tree_util.register_dataclass(SelfAttentionMask, data_fields=["segment_ids_bt"], meta_fields=["impl", "platform"])


def self_attention_mask(
    attention_mask_bt: jax.Array, segment_ids_bt: jax.Array | None = None, impl: str = "auto",
    platform: str | None = None,
) -> SelfAttentionMask:
    """The layers' mask, with the impl as asked ("auto" stays "auto") and the program's platform."""
    resolve_attention_impl(impl, platform)  # an unknown name fails here
    return SelfAttentionMask(segment_ids_for_attention(attention_mask_bt, segment_ids_bt), impl,
                             None if platform is None else normalise(platform))
