"""Decode attention alone: the paged engine's "blocked" kernel at one query per row, each way of forming a
block's products (`tx.kernels.paged_attention.DECODE_PRODUCTS`), at several row counts.

    python benchmarks/bench_decode_attention.py --rows 1 8 64 256 512 --context 160 160 160 256 200

Per (rows, context): random pools of `--layers` layers of pages (`--page` tokens, `--kv-heads` x `--head-dim`,
float32), each row's pages shuffled over the pool, each row's position drawn in [context / 2, context); one
jitted program runs the layers' attention one after the other (each layer's output is the next's query), timed
warm over `--iters` calls. One JSON line per (rows, products): per-layer time (best and median), the largest
difference from the first products' output, and the products `decode_products` picks on this platform.

`--group N --prompt P`: the RL layout instead. Rows come in groups of N samples of one P-token prompt: a
group's rows hold the prompt's full pages (but the last partial one) in common, then pages of their own, and
sit at positions drawn in [P, context). Two lines per (rows, context), the products `decode_products` picks:
each row reading its whole table, and the shared pages read once per segment of rows as the engine plans
them (`tx/sampling/prefix_segments.py`, `tx/kernels/shared_prefix.py`; "shared_prefix": true).

    python benchmarks/bench_decode_attention.py --rows 512 --context 272 --group 16 --prompt 128 --kv-block 32

`--segment-rows C` plans segments of C rows instead of the engine's `SHARED_PREFIX_ROWS`.
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
    parser.add_argument("--group", type=int, default=0, help="rows per prompt (0: every row its own pages)")
    parser.add_argument("--prompt", type=int, default=128, help="with --group: the shared prompt's tokens")
    parser.add_argument("--segment-rows", type=int, default=0,
                        help="with --group: most rows per segment, a power of two (0: the engine's SHARED_PREFIX_ROWS)")
    args = parser.parse_args()
    if len(args.context) != len(args.rows):
        parser.error(f"--context has {len(args.context)} values for {len(args.rows)} --rows")

    import jax
    import jax.numpy as jnp

    from tx.kernels.paged_attention import DECODE_PRODUCTS, blocked_paged_attention, decode_products
    from tx.kernels.platform import platform_of
    from tx.kernels.shared_prefix import SharedPrefix
    from tx.sampling.prefix_segments import SHARED_PREFIX_ROWS, plan_segments, segment_rows

    most = args.segment_rows or SHARED_PREFIX_ROWS

    platform = platform_of()
    for rows, ctx in zip(args.rows, args.context):
        width = -(-ctx // args.page)
        rng = np.random.default_rng(0)
        if args.group:
            table, pos = grouped_tables(rng, rows, width, args.group, args.prompt, ctx, args.page)
        else:
            table = rng.permutation(np.arange(1, rows * width + 1)).reshape(rows, width).astype(np.int32)
            pos = rng.integers(ctx // 2, ctx, (rows, 1)).astype(np.int32)
        shape = (args.layers, int(table.max()) + 1, args.page, args.kv_heads, args.head_dim)  # page 0: trash
        k_pool = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
        v_pool = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
        q = jnp.asarray(rng.standard_normal((rows, 1, args.heads, args.head_dim), dtype=np.float32))
        picked = decode_products(rows, platform)
        if args.group:
            plan = plan_segments(table.tolist(), pos[:, 0].tolist(), rows, 1, width, args.page, args.kv_block, most)
            shared = SharedPrefix(*(jnp.asarray(plan[k]) for k in ("order_s", "place_s", "table_nw", "len_s")))
            variants = [(picked, None), (picked, shared)]
        else:
            variants = [(products, None) for products in DECODE_PRODUCTS]
        table, pos = jnp.asarray(table), jnp.asarray(pos)
        first = None
        for products, prefix in variants:
            def layers(q, k_pool, v_pool, table, pos, prefix, products=products):
                for layer in range(args.layers):
                    q = blocked_paged_attention(q, k_pool, v_pool, layer, table, pos, args.head_dim**-0.5,
                                                kv_block=args.kv_block, products=products, prefix=prefix)
                return q

            run = jax.jit(layers)
            out = jax.block_until_ready(run(q, k_pool, v_pool, table, pos, prefix))
            times = []
            for _ in range(args.iters):
                start = time.perf_counter()
                jax.block_until_ready(run(q, k_pool, v_pool, table, pos, prefix))
                times.append(time.perf_counter() - start)
            first = out if first is None else first
            line = {"workload": "decode_attention", "products": products, "picked": picked,
                    "shapes": {"rows": rows, "context": ctx, "layers": args.layers, "heads": args.heads,
                               "kv_heads": args.kv_heads, "head_dim": args.head_dim, "page": args.page,
                               "kv_block": args.kv_block, "dtype": "float32"}}
            if args.group:
                line["shapes"] |= {"group": args.group, "prompt": args.prompt,
                                   "segment_rows": segment_rows(rows, 1, most)}
                line["shared_prefix"] = prefix is not None
            print(json.dumps(line | {
                "layer_ms_best": round(min(times) / args.layers * 1e3, 3),
                "layer_ms_median": round(float(np.median(times)) / args.layers * 1e3, 3),
                "max_abs_diff": float(jnp.max(jnp.abs(out - first))),
                "device": f"{platform}:{jax.devices()[0].device_kind}", "jax": jax.__version__}), flush=True)


def grouped_tables(rng: np.random.Generator, rows: int, width: int, group: int, prompt: int, ctx: int,
                   page: int) -> tuple[np.ndarray, np.ndarray]:
    """Page tables `[rows, width]` of groups of `group` rows sharing a `prompt`-token prompt's full pages (up
    to its last token, as the engine prefills it), shuffled page ids, and positions in [prompt, ctx)."""
    shared = (prompt - 1) // page
    ids = iter(rng.permutation(np.arange(1, rows * width + 1)))
    table = np.zeros((rows, width), np.int32)
    for start in range(0, rows, group):
        common = [next(ids) for _ in range(shared)]
        for r in range(start, min(start + group, rows)):
            table[r] = common + [next(ids) for _ in range(width - shared)]
    return table, rng.integers(prompt, ctx, (rows, 1)).astype(np.int32)


if __name__ == "__main__":
    main()
