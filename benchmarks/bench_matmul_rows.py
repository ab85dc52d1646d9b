"""How fast does XLA on this machine stream a decode step's weights through a matmul of a few rows?

    python benchmarks/bench_matmul_rows.py                      # the ~100M shape's matmuls at 1, 8, 32 rows
    python benchmarks/bench_matmul_rows.py --cores 1 --rows 1   # the same on one core (sched_setaffinity)

A decode step reads every weight once, so its floor is the weights' bytes over the rate at which a matmul of
`rows` rows reads them. Each line times a chain of distinct `[rows, in] x weight` products over `--mb` MB of
weights (larger than the CPU's caches, as a model's layers are), `--passes` passes over the chain in one
program, the weight stored `[in, out]` (the model's kernels) or `[out, in]` (tx's CPU decode copies of the
dense kernels) under XLA's matmul, or `[out, in]` under tx's decode product (`out_in_product`: a multiply and
a sum at 2-32 rows). Also a `stream` line: one `[N, in] x [in]` product over `--mb` MB, this machine's read
bandwidth as XLA reaches it. One JSON line each: best and median ms per matmul, GB/s of weights, GFLOPS,
cores, jax.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

# bench_peer's ~100M Qwen3: q/o, k/v, gate/up, down, the untied head
SHAPES = ["768x768", "768x256", "768x2048", "2048x768", "768x32000"]


def chain_program(rows: int, n_in: int, n_out: int, count: int, layout: str, passes: int):
    """(jitted run(x, weights), x, weights): `passes` passes of one `[rows, n_in]` product per weight."""
    import jax
    import jax.numpy as jnp

    from tx.kernels.out_in import out_in_product

    rng = np.random.default_rng(0)
    shape = (n_in, n_out) if layout == "in_out" else (n_out, n_in)
    weights = [jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.02) for _ in range(count)]
    x = jnp.asarray(rng.standard_normal((rows, n_in), dtype=np.float32))

    def product(x_ni, w):
        if layout == "out_in_product":  # tx's decode product: a multiply and a sum at 2-32 rows
            return out_in_product(x_ni[:, None], w)[:, 0]
        contract = (((1,), (0,)), ((), ())) if layout == "in_out" else (((1,), (1,)), ((), ()))
        return jax.lax.dot_general(x_ni, w, contract)

    @jax.jit
    def run(x, weights):
        def one_pass(_, acc):
            for w in weights:  # each product's input depends on the last: nothing runs ahead
                acc = acc + product(x + acc * 1e-9, w)[:, :1]
            return acc
        return jax.lax.fori_loop(0, passes, one_pass, jnp.zeros((rows, 1), jnp.float32))

    return run, x, weights


def stream_program(n_in: int, mb: float):
    import jax
    import jax.numpy as jnp

    n = max(1, int(mb * 2**20 / 4 / n_in))
    return jax.jit(lambda a, v: a @ v), jnp.ones((n, n_in), jnp.float32), jnp.ones((n_in,), jnp.float32)


def time_it(fn, repeats: int) -> list[float]:
    import jax

    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="weights as INxOUT")
    parser.add_argument("--layouts", nargs="+", choices=["in_out", "out_in", "out_in_product"],
                        default=["in_out", "out_in", "out_in_product"],
                        help="the weight stored [in, out] or [out, in] under XLA's matmul, or [out, in] under "
                             "tx.kernels.out_in.out_in_product (a multiply and a sum at 2-32 rows)")
    parser.add_argument("--mb", type=float, default=400.0, help="MB of distinct weights per chain")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cores", type=int, default=0, help="pin the process to this many cores (0: all)")
    args = parser.parse_args()
    if args.cores:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: args.cores]))
    import jax  # after pinning: XLA's threads inherit the affinity

    base = {"jax": jax.__version__, "device": jax.devices()[0].platform, "cores": len(os.sched_getaffinity(0))}
    run, a, v = stream_program(768, args.mb)
    times = time_it(lambda: run(a, v), args.repeats)
    print(json.dumps({"workload": "stream", "mb": round(a.nbytes / 2**20), "best_ms": round(min(times) * 1e3, 2),
                      "gb_per_s": round(a.nbytes / min(times) / 1e9, 1)} | base), flush=True)
    for spec in args.shapes:
        n_in, n_out = (int(x) for x in spec.split("x"))
        count = max(2, int(args.mb * 2**20 / (4 * n_in * n_out)))
        for layout in args.layouts:
            for rows in args.rows:
                run, x, weights = chain_program(rows, n_in, n_out, count, layout, args.passes)
                per = [t / (count * args.passes) for t in time_it(lambda: run(x, weights), args.repeats)]
                nbytes = 4 * n_in * n_out
                print(json.dumps({"workload": "matmul_rows", "rows": rows, "weight": [n_in, n_out], "layout": layout,
                                  "weights_in_chain": count, "best_ms": round(min(per) * 1e3, 4),
                                  "median_ms": round(statistics.median(per) * 1e3, 4),
                                  "gb_per_s": round(nbytes / min(per) / 1e9, 1),
                                  "gflops": round(2 * rows * n_in * n_out / min(per) / 1e9, 1)} | base), flush=True)
                del run, x, weights


if __name__ == "__main__":
    main()
