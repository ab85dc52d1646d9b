"""Step a: tx's cuDNN attention path — bf16 parity against the float32 reference, and its speed.

Parity (`attention_parity_unpacked`, `attention_parity_packed`): random bf16 q/k/v (GQA), causal, through
`self_attention(..., impl="cudnn")`, compared with `reference_self_attention` on the same values in float32,
over the real (non-padding) query positions: max abs error, and `within_tolerance` (max abs error <=
`tolerance`). Unpacked rows are one right-padded sequence each (what cuDNN takes); packed rows hold several
segments, which tx must route to its blockwise kernel. `ran` says which branch ran: the output is compared
bit for bit with tx's blockwise kernel and with cuDNN called directly (`jax.nn.dot_product_attention`,
implementation="cudnn", GPU only); `ran_by` = "bitwise" when one matched exactly, else "closest". Off GPU
the cuDNN dispatch falls back to blockwise (logged once), so the dry run records `"ran": "blockwise"`.

Timing (`attention_time_t<time_len>`, t4096 on the device): forward, and forward + backward (gradients of q, k, v), of the cuDNN path
and of the blockwise kernel on unpacked rows of `time_len` tokens; medians of `repeats` warm calls.
"""

from __future__ import annotations

import math

import numpy as np

from suite import Device, Results, jax_step, median_time


def inputs(rng, batch, t, heads, kv_heads, head_dim):
    import jax.numpy as jnp

    def draw(h):
        return jnp.asarray(rng.standard_normal((batch, t, h, head_dim)), jnp.bfloat16)

    return draw(heads), draw(kv_heads), draw(kv_heads)


def unpacked_segments(batch: int, t: int) -> np.ndarray:
    """One segment per row, right-padded (-1): full length, then shorter rows."""
    seg = np.full((batch, t), -1, np.int32)
    for b in range(batch):
        seg[b, : t - b * (t // 3) // max(batch - 1, 1)] = 0
    return seg


def packed_segments(batch: int, t: int) -> np.ndarray:
    """Each row packs 3 segments of unequal lengths, then padding."""
    seg = np.full((batch, t), -1, np.int32)
    cuts = [0, int(t * 0.35), int(t * 0.8), int(t * 0.95)]
    for b in range(batch):
        for s in range(3):
            seg[b, cuts[s] : cuts[s + 1]] = s
    return seg


def takes_cudnn(seg: np.ndarray) -> bool:
    """Independent of tx: every row one segment, right-padded (what the sequence-length API expresses)."""
    for row in seg:
        real = row >= 0
        n = int(real.sum())
        if not real[:n].all() or len(set(row[real].tolist())) > 1:
            return False
    return True


def parity(results: Results, device: Device, w: dict, packed: bool) -> None:
    import jax
    import jax.numpy as jnp

    from tx.kernels.attention import reference_self_attention, self_attention
    from tx.kernels.flash import blockwise_attention

    name = "attention_parity_packed" if packed else "attention_parity_unpacked"
    with results.workload(name) as row:
        b, t, h, kv, d = w["batch"], w["parity_len"], w["heads"], w["kv_heads"], w["head_dim"]
        row["shapes"] = {"batch": b, "seq_len": t, "heads": h, "kv_heads": kv, "head_dim": d, "dtype": "bfloat16"}
        seg_np = packed_segments(b, t) if packed else unpacked_segments(b, t)
        q, k, v = inputs(np.random.default_rng(1 if packed else 0), b, t, h, kv, d)
        seg = jnp.asarray(seg_np)
        scale = 1.0 / math.sqrt(d)
        tx_cudnn = jax.jit(lambda q, k, v, s: self_attention(q, k, v, s, scale, impl="cudnn"))
        blockwise = jax.jit(lambda q, k, v, s: blockwise_attention(q, k, v, s, scale))
        reference = jax.jit(lambda q, k, v, s: reference_self_attention(
            q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), s, scale))
        out = np.asarray(jax.block_until_ready(tx_cudnn(q, k, v, seg)).astype(jnp.float32))
        ref = np.asarray(reference(q, k, v, seg))
        blk = np.asarray(blockwise(q, k, v, seg).astype(jnp.float32))
        real = seg_np >= 0  # padding queries return finite garbage, never compared
        err = float(np.abs(out - ref)[real].max())
        candidates = {"blockwise": blk}
        if device.platform in ("gpu", "cuda"):
            lengths = jnp.asarray(real.sum(1).astype(np.int32))
            direct = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, scale=scale, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                implementation="cudnn"))
            try:
                candidates["cudnn"] = np.asarray(direct(q, k, v).astype(jnp.float32))
            except Exception as exc:  # noqa: BLE001 - cuDNN refused these inputs: say so, compare with blockwise
                row["direct_cudnn_error"] = f"{type(exc).__name__}: {exc}"[:500]
        diffs = {name: float(np.abs(out - c)[real].max()) for name, c in candidates.items()}
        exact = [name for name, diff in diffs.items() if diff == 0.0]
        row["ran"] = exact[0] if len(exact) == 1 else min(diffs, key=diffs.get)
        row["ran_by"] = "bitwise" if len(exact) == 1 else "closest"
        row["max_abs_diff_to"] = diffs
        row["cudnn_takes_rows"] = takes_cudnn(seg_np)  # what should run on GPU: cuDNN iff True
        row["expected"] = "cudnn" if takes_cudnn(seg_np) and device.platform in ("gpu", "cuda") else "blockwise"
        row["max_abs_error"] = err
        row["blockwise_max_abs_error"] = float(np.abs(blk - ref)[real].max())
        row["tolerance"] = w["tolerance"]
        row["within_tolerance"] = err <= w["tolerance"]
        row["ran_as_expected"] = row["ran"] == row["expected"]
        if not row["within_tolerance"]:
            raise AssertionError(f"max abs error {err:.3g} > tolerance {w['tolerance']}")


def timing(results: Results, device: Device, w: dict) -> None:
    import jax
    import jax.numpy as jnp

    from tx.kernels.attention import self_attention
    from tx.kernels.flash import blockwise_attention

    with results.workload(f"attention_time_t{w['time_len']}") as row:
        b, t, h, kv, d = w["time_batch"], w["time_len"], w["heads"], w["kv_heads"], w["head_dim"]
        row["shapes"] = {"batch": b, "seq_len": t, "heads": h, "kv_heads": kv, "head_dim": d, "dtype": "bfloat16",
                         "rows": "unpacked, full length"}
        q, k, v = inputs(np.random.default_rng(2), b, t, h, kv, d)
        seg = jnp.zeros((b, t), jnp.int32)
        scale = 1.0 / math.sqrt(d)
        kernels = {"cudnn": lambda q, k, v: self_attention(q, k, v, seg, scale, impl="cudnn"),
                   "blockwise": lambda q, k, v: blockwise_attention(q, k, v, seg, scale)}
        fwd_flops = 2.0 * b * h * d * t * t  # causal: QK^T and PV over the visible half
        times = {}
        for name, fn in kernels.items():
            fwd = jax.jit(fn)
            grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
            for f in (fwd, grad):
                jax.block_until_ready(f(q, k, v))  # compile
            times[f"{name}_fwd_s"] = median_time(lambda: fwd(q, k, v), w["repeats"], jax.block_until_ready)
            times[f"{name}_fwd_bwd_s"] = median_time(lambda: grad(q, k, v), w["repeats"], jax.block_until_ready)
        row.update({key: round(s, 6) for key, s in times.items()})
        row["step_time_s"] = row["cudnn_fwd_s"]
        row["tokens_per_s"] = round(b * t / times["cudnn_fwd_s"], 1)
        row["tflops_per_s"] = {key.removesuffix("_s"): round(fwd_flops * (3 if "bwd" in key else 1) / s / 1e12, 2)
                               for key, s in times.items()}
        row["speedup_cudnn_over_blockwise_fwd"] = round(times["blockwise_fwd_s"] / times["cudnn_fwd_s"], 3)
        row["speedup_cudnn_over_blockwise_fwd_bwd"] = round(times["blockwise_fwd_bwd_s"] / times["cudnn_fwd_bwd_s"], 3)
        if device.peak_flops:
            row["mfu"] = round(fwd_flops / times["cudnn_fwd_s"] / device.peak_flops, 4)


def main() -> None:
    args, device, results, w, _ = jax_step("a", __doc__, "attention")
    parity(results, device, w, packed=False)
    parity(results, device, w, packed=True)
    timing(results, device, w)


if __name__ == "__main__":
    main()
