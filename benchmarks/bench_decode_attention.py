"""Decode attention alone: the paged engine's "blocked" kernel at one query per row, each way of forming a
block's products (`tx.kernels.paged_attention.DECODE_PRODUCTS`), at several row counts.

    python benchmarks/bench_decode_attention.py --rows 1 8 64 256 512 --context 160 160 160 256 200

Per (rows, context): random pools of `--layers` layers of pages (`--page` tokens, `--kv-heads` x `--head-dim`,
float32), each row's pages shuffled over the pool, each row's position drawn in [context / 2, context); one
jitted program runs the layers' attention one after the other (each layer's output is the next's query), timed
warm over `--iters` calls. One JSON line per (rows, products): per-layer time (best and median), the largest
difference from the first products' output, and the products `decode_products` picks on this platform.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 512])
    parser.add_argument("--context", type=int, nargs="+", default=[160, 160, 160, 256, 200],
                        help="cached tokens per row, one per --rows entry")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--kv-block", type=int, default=64)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    if len(args.context) != len(args.rows):
        parser.error(f"--context has {len(args.context)} values for {len(args.rows)} --rows")

    import jax
    import jax.numpy as jnp

    from tx.kernels.paged_attention import DECODE_PRODUCTS, blocked_paged_attention, decode_products
    from tx.kernels.platform import platform_of

    platform = platform_of()
    for rows, ctx in zip(args.rows, args.context):
        width = -(-ctx // args.page)
        pages = rows * width + 1  # page 0: the trash page
        rng = np.random.default_rng(0)
        shape = (args.layers, pages, args.page, args.kv_heads, args.head_dim)
        k_pool = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
        v_pool = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
        table = jnp.asarray(rng.permutation(np.arange(1, pages)).reshape(rows, width).astype(np.int32))
        q = jnp.asarray(rng.standard_normal((rows, 1, args.heads, args.head_dim), dtype=np.float32))
        pos = jnp.asarray(rng.integers(ctx // 2, ctx, (rows, 1)).astype(np.int32))
        first = None
        for products in DECODE_PRODUCTS:
            def layers(q, k_pool, v_pool, table, pos, products=products):
                for layer in range(args.layers):
                    q = blocked_paged_attention(q, k_pool, v_pool, layer, table, pos, args.head_dim**-0.5,
                                                kv_block=args.kv_block, products=products)
                return q

            run = jax.jit(layers)
            out = jax.block_until_ready(run(q, k_pool, v_pool, table, pos))
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                jax.block_until_ready(run(q, k_pool, v_pool, table, pos))
                times.append(time.perf_counter() - start)
            first = out if first is None else first
            print(json.dumps({
                "workload": "decode_attention", "products": products, "picked": decode_products(rows, platform),
                "shapes": {"rows": rows, "context": ctx, "layers": args.layers, "heads": args.heads,
                           "kv_heads": args.kv_heads, "head_dim": args.head_dim, "page": args.page,
                           "kv_block": args.kv_block, "dtype": "float32"},
                "layer_ms_best": round(min(times) / args.layers * 1e3, 3),
                "layer_ms_median": round(float(np.median(times)) / args.layers * 1e3, 3),
                "max_abs_diff": float(jnp.max(jnp.abs(out - first))),
                "device": f"{platform}:{jax.devices()[0].device_kind}", "jax": jax.__version__}), flush=True)


if __name__ == "__main__":
    main()
