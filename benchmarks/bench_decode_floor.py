"""How fast can XLA decode this shape on this machine at all? A bound for bench_sample.py's decode figures.

    python benchmarks/bench_decode_floor.py --batch 64 --context 128

A plain greedy decode step written directly in jax.numpy — base weights only (no LoRA), one contiguous
KV cache per layer (no pages), argmax sampling — run for `--steps` steps in one `lax.scan`, timed warm:

  * `plain`: the whole step, attention over the `--context` cached positions included;
  * `no_attention`: the same step with attention replaced by its query (every matmul, norm, embedding
    lookup and the argmax are still there) — what the step costs when attention is free.

Also measured: this machine's memory read bandwidth (numpy sums on every core), and from it the time to read every cached K
and V once per step, which no attention kernel can beat. `no_attention` + that read time bounds the decode
step of any XLA program of this shape from below; tx's paged engine (bench_sample.py) adds LoRA over many
adapters and page tables on top. One JSON line per variant, then a `bound` line.
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from common import add_model_args, timed


def decode_program(args, attention: bool):
    """(jitted run(tokens [b], caches) -> tokens, caches) of `args.steps` greedy decode steps, and its inputs."""
    import jax
    import jax.numpy as jnp

    b, hidden, layers = args.batch, args.hidden_size, args.num_layers
    heads, kv, d = args.num_heads, args.num_kv_heads, args.head_dim or args.hidden_size // args.num_heads
    ctx = args.context + args.steps
    keys = iter(jax.random.split(jax.random.key(0), 4 * layers + 2))

    def normal(*shape):
        return jax.random.normal(next(keys), shape, jnp.float32) * 0.02

    weights = {"embed": normal(args.vocab_size, hidden), "head": normal(args.vocab_size, hidden),
               "layers": [{"qkv": normal(hidden, (heads + 2 * kv) * d), "o": normal(heads * d, hidden),
                           "gate_up": normal(hidden, 2 * args.intermediate_size),
                           "down": normal(args.intermediate_size, hidden)} for _ in range(layers)]}
    caches = tuple(jnp.zeros((b, ctx, kv, d), jnp.float32) for _ in range(2 * layers))

    def rms(x):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)

    def step(carry, _):
        tokens, pos, caches = carry
        caches = list(caches)
        x = weights["embed"][tokens]
        for i, w in enumerate(weights["layers"]):
            q, k, v = jnp.split(rms(x) @ w["qkv"], [heads * d, (heads + kv) * d], -1)
            caches[2 * i] = jax.lax.dynamic_update_slice(caches[2 * i], k.reshape(b, 1, kv, d), (0, pos, 0, 0))
            caches[2 * i + 1] = jax.lax.dynamic_update_slice(caches[2 * i + 1], v.reshape(b, 1, kv, d), (0, pos, 0, 0))
            if attention:
                q = q.reshape(b, kv, heads // kv, d)
                scores = jnp.einsum("bkgd,btkd->bkgt", q, caches[2 * i]) / np.sqrt(d)
                probs = jax.nn.softmax(jnp.where(jnp.arange(ctx) <= pos, scores, -jnp.inf), -1)
                q = jnp.einsum("bkgt,btkd->bkgd", probs, caches[2 * i + 1])
            x = x + q.reshape(b, heads * d) @ w["o"]
            gate, up = jnp.split(rms(x) @ w["gate_up"], 2, -1)
            x = x + (jax.nn.silu(gate) * up) @ w["down"]
        tokens = jnp.argmax(rms(x) @ weights["head"].T, -1).astype(jnp.int32)
        return (tokens, pos + 1, tuple(caches)), None

    @jax.jit
    def run(tokens, caches):
        (tokens, _, caches), _ = jax.lax.scan(step, (tokens, jnp.int32(args.context), caches), None, length=args.steps)
        return tokens, caches

    return run, jnp.zeros((b,), jnp.int32), caches


def read_bandwidth(nbytes: int = 400_000_000) -> float:
    """Bytes per second read from memory: numpy sums of `nbytes`, split over every core, best of 3."""
    chunks = np.array_split(np.ones(nbytes // 4, np.float32), os.cpu_count() or 1)
    with ThreadPoolExecutor(len(chunks)) as pool:
        best = min(timed(lambda: list(pool.map(np.sum, chunks))) for _ in range(3))
    return nbytes / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1536)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=128, help="cached positions when the timed steps start (the prompt)")
    parser.add_argument("--steps", type=int, default=31)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import jax

    shapes = {"batch": args.batch, "context": args.context, "hidden": args.hidden_size, "layers": args.num_layers,
              "heads": args.num_heads, "kv_heads": args.num_kv_heads, "vocab": args.vocab_size}
    device = jax.devices()[0].device_kind
    step_s = {}
    for name, attention in (("plain", True), ("no_attention", False)):
        run, tokens, caches = decode_program(args, attention)
        jax.block_until_ready(run(tokens, caches))
        best = min(timed(lambda: jax.block_until_ready(run(tokens, caches))) for _ in range(args.repeats))
        step_s[name] = best / args.steps
        print(json.dumps({"workload": f"decode_floor_{name}", "shapes": shapes, "step_time_s": round(step_s[name], 5),
                          "decode_tokens_per_s": round(args.batch / step_s[name], 1), "device": device}), flush=True)
    head_dim = args.head_dim or args.hidden_size // args.num_heads
    kv_bytes = 2 * args.num_layers * args.batch * (args.context + args.steps / 2) * args.num_kv_heads * head_dim * 4
    read_s = kv_bytes / read_bandwidth()
    bound = step_s["no_attention"] + read_s
    print(json.dumps({"workload": "decode_floor_bound", "shapes": shapes, "kv_bytes_per_step": int(kv_bytes),
                      "kv_read_s": round(read_s, 5), "step_time_s": round(bound, 5),
                      "decode_tokens_per_s": round(args.batch / bound, 1), "device": device}), flush=True)


if __name__ == "__main__":
    main()
