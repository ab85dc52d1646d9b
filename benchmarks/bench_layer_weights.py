"""What one decode step pays for reading its layers' weights out of a stacked `[L, in, out]` array.

    python benchmarks/bench_layer_weights.py                       # Qwen3-0.6B's and the 100M peer model's MLP
    python benchmarks/bench_layer_weights.py --layers 8 --hidden 768 --intermediate 2048

One token goes through L SwiGLU MLPs (gate, up, down: the weights a decode step reads most), three ways:
- `scan`: the weights stacked `[L, ...]` and the layers under `lax.scan` (what tx's model does; each
  step slices its layer's weights out of the stack);
- `static_index`: the same stack, the layers unrolled with `w[i]` (static slices);
- `per_layer`: one array per layer, the layers unrolled (what an engine holding each layer's weights
  apart, e.g. SkyRL's JAX backend or a scan-free MaxText, does).
Reports the median time per step, the bytes of weights read, the effective bandwidth, and the copies
(dynamic-slice / slice / copy ops) in each compiled program. One JSON line per variant.
A diagnostic for the decode issue (issue 29's note): on this project's 2-core CPU, copying the sliced
weights cost more than the matmuls in a batch-1 decode step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--rows", type=int, default=1, help="decode rows (tokens) per step")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    layers, d, f = args.layers, args.hidden, args.intermediate
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)

    def weights(shape):
        return jnp.asarray(rng.standard_normal(shape) * 0.02, dtype)

    stacked = {"gate": weights((layers, d, f)), "up": weights((layers, d, f)), "down": weights((layers, f, d))}
    apart = [{k: v[i] for k, v in stacked.items()} for i in range(layers)]
    x_bd = jnp.ones((args.rows, d), dtype)

    def mlp(h_bd, w):
        return h_bd + (jax.nn.silu(h_bd @ w["gate"]) * (h_bd @ w["up"])) @ w["down"]

    def scan(h_bd, ws):
        return jax.lax.scan(lambda h, w: (mlp(h, w), None), h_bd, ws)[0]

    def static_index(h_bd, ws):
        for i in range(layers):
            h_bd = mlp(h_bd, {k: v[i] for k, v in ws.items()})
        return h_bd

    def per_layer(h_bd, ws):
        for w in ws:
            h_bd = mlp(h_bd, w)
        return h_bd

    weight_bytes = 3 * layers * d * f * dtype.itemsize
    for name, fn, ws in (("scan", scan, stacked), ("static_index", static_index, stacked),
                         ("per_layer", per_layer, apart)):
        jitted = jax.jit(fn)
        hlo = jitted.lower(x_bd, ws).compile().as_text()
        jitted(x_bd, ws).block_until_ready()
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            jitted(x_bd, ws).block_until_ready()
            times.append(time.perf_counter() - start)
        step = statistics.median(times)
        print(json.dumps({
            "workload": "decode_mlp_weights", "variant": name,
            "shapes": {"layers": layers, "hidden": d, "intermediate": f, "rows": args.rows, "dtype": args.dtype},
            "step_time_s": round(step, 6), "weight_bytes": weight_bytes,
            "effective_gb_per_s": round(weight_bytes / step / 1e9, 2),
            "copy_ops": {op: hlo.count(f" {op}(") for op in ("dynamic-slice", "slice", "copy")},
            "device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
        }), flush=True)


if __name__ == "__main__":
    main()
