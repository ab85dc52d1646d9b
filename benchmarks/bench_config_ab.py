"""Two tx sampling configs side by side in one process: which is faster, beyond one process's noise.

Both backends load the same random checkpoint (bench_peer's shape and writer: transformers' `save_pretrained`),
compile on one warm-up call each, then run `--calls` rounds; each round samples new prompts (`--batch` prompts of
`--prompt-len` tokens, `--samples` rows each, `--new-tokens` tokens through one adapter, greedy or seeded at
`--temperature`) on both, in alternating order. Between
processes this 2-core VM varies by 5-10% (an A/A run, the same config twice, shows it), which hides effects of
a few percent; within one process the two configs share the machine's state. One JSON line: per config the
median and best call time and tokens/s, the ratio b / a of the medians and the median of the rounds' ratios
(above 1: a is faster), whether the tokens were identical in every round, and each backend's sampling counters
(calls, chained calls, rows reading shared pages).

    python benchmarks/bench_config_ab.py --a '{}' --b '{"paged_async_dispatch": false}' --batch 8 --new-tokens 256
    python benchmarks/bench_config_ab.py --a-set '{"tx.models.decoder.PAGED_MLP_TOKENS": {}}' --batch 64 --new-tokens 32
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_peer import TxEngine, peak_rss_mb, write_checkpoint
from common import add_model_args


def _constant(name: str):
    module, attr = name.rsplit(".", 1)
    return getattr(importlib.import_module(module), attr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, hidden=768, layers=8, heads=12, kv_heads=4, intermediate=2048, head_dim=64)
    parser.add_argument("--a", default="{}", help="JSON of JaxBackendConfig fields of config a")
    parser.add_argument("--b", default="{}", help="JSON of JaxBackendConfig fields of config b")
    parser.add_argument("--a-set", default="{}", help="JSON {\"module.CONSTANT\": value}: tx module constants that "
                        "config a builds and traces its programs under (e.g. tx.models.decoder.PAGED_MLP_TOKENS), "
                        "set before each of its calls")
    parser.add_argument("--b-set", default="{}", help="the same for config b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=6, help="measured rounds (each config once per round)")
    parser.add_argument("--samples", type=int, default=1, help="rows per prompt (an RL group: they share its pages)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: seeded samples")
    parser.add_argument("--max-tokens", type=int, nargs=2, metavar=("LO", "HI"),
                        help="max_tokens per prompt drawn in [LO, HI] (the same draws in every round; an RL "
                        "rollout's rows end at different steps); default: `--new-tokens` for every prompt")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, to check the script works")
    args = parser.parse_args()
    if args.quick:
        args.hidden_size, args.num_layers, args.intermediate_size, args.vocab_size = 64, 2, 128, 512
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 16
        args.prompt_len, args.new_tokens, args.calls = 16, 12, 2
    import jax

    configs = {"a": json.loads(args.a), "b": json.loads(args.b)}
    constants = {"a": json.loads(args.a_set), "b": json.loads(args.b_set)}
    originals = {name: _constant(name) for name in {**constants["a"], **constants["b"]}}

    def use(config: str) -> None:  # the constants as config `config` sets them (the others as tx has them)
        for name, value in {**originals, **constants[config]}.items():
            module, attr = name.rsplit(".", 1)
            setattr(importlib.import_module(module), attr, value)

    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, args.vocab_size, (args.batch, args.prompt_len)).tolist()
               for _ in range(args.calls + 1)]
    max_tokens = ([args.new_tokens] * args.batch if args.max_tokens is None
                  else rng.integers(args.max_tokens[0], args.max_tokens[1] + 1, args.batch).tolist())
    seq = args.prompt_len + max(max_tokens) + 1
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        params = write_checkpoint(model_dir, args)
        engines = {}
        for name, extra in configs.items():
            use(name)
            engines[name] = TxEngine(str(model_dir), 1, seq, extra)
        warmup = {}
        for name, engine in engines.items():
            use(name)
            start = time.perf_counter()
            engine.backend.sample(engine.sample_batch(prompts[-1], args.samples, max_tokens, args.temperature))
            warmup[name] = round(time.perf_counter() - start, 2)
        times: dict[str, list[float]] = {"a": [], "b": []}
        identical = True
        for i in range(args.calls):
            tokens = {}
            for name in ("a", "b") if i % 2 == 0 else ("b", "a"):
                engine = engines[name]
                use(name)
                request = engine.sample_batch(prompts[i], args.samples, max_tokens, args.temperature)
                start = time.perf_counter()
                out = engine.backend.sample(request)
                times[name].append(time.perf_counter() - start)
                tokens[name] = [s.tokens for key in sorted(out) for s in out[key].sequences]
            identical &= tokens["a"] == tokens["b"]
    generated = args.samples * sum(max_tokens)
    line = {"workload": "config_ab", "shapes": {"hidden": args.hidden_size, "layers": args.num_layers,
                                                "vocab": args.vocab_size, "batch": args.batch,
                                                "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                                                "max_tokens": args.max_tokens,
                                                "samples": args.samples, "temperature": args.temperature,
                                                "params": params},
            "configs": configs, "constants": constants, "calls": args.calls, "identical_tokens": identical,
            "warmup_s": warmup,
            "peak_rss_mb": peak_rss_mb(), "jax": jax.__version__, "device": jax.devices()[0].platform}
    for name, ts in times.items():
        counters = engines[name].backend.metrics.sampling
        line[name] = {"median_s": round(statistics.median(ts), 4), "best_s": round(min(ts), 4),
                      "tokens_per_s": round(generated / statistics.median(ts), 2),
                      "times_s": [round(t, 3) for t in ts],
                      "calls": counters.get("calls"), "chained_calls": counters.get("chained_calls"),
                      "shared_prefix_rows": counters.get("shared_prefix_rows")}
    line["ratio_b_over_a_time"] = round(statistics.median(times["b"]) / statistics.median(times["a"]), 4)
    line["ratio_b_over_a_paired"] = round(statistics.median(b / a for a, b in zip(times["a"], times["b"])), 4)
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
