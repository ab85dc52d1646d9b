"""KV-cache memory per token: DeepSeek-V3's latent (MLA) paged cache vs a grouped-query (Qwen3) one at the same
hidden size, measured from the pools the paged engine allocates, with the same sampling workload on each.

    python benchmarks/bench_kv_memory.py                       # DeepSeek-V2-Lite-sized attention, 2 layers
    python benchmarks/bench_kv_memory.py --num-kv-heads 8 --num-layers 4

Both models share the shape flags (hidden size, heads, layers, vocab); the GQA model has `--num-kv-heads` heads of
`--head-dim`, the MLA model a `--kv-lora-rank` latent plus a `--qk-rope-head-dim` RoPE key per token (its heads
have `--head-dim` non-RoPE query/key and value dims). One JSON line per family: bytes per token and layer as the
pools hold them (pool bytes / positions), what transformers' own cache holds for the same model, the peak KV bytes
of the workload (`--rows` rows of `--prompt-len` prompt tokens and `--new-tokens` greedy tokens) and its tokens/s;
then the MLA / GQA ratio. Per-token bytes do not depend on the layer count: pass the real one to see a whole
model's (the line's `kv_bytes_per_token` is over all layers).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from bench_sample import hf_kv_bytes_per_token
from common import PeakRSS, add_model_args, random_model


def measure(model_dir: Path, params: int, args) -> dict:
    import jax

    import tx
    from tx import types

    backend = tx.JaxBackend(str(model_dir), tx.JaxBackendConfig(
        max_lora_adapters=2, max_lora_rank=8, max_seq_len=args.prompt_len + args.new_tokens + 1))
    backend.create_model("m0", types.LoraConfig(rank=8, seed=0))
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, args.vocab_size, (args.rows, args.prompt_len)).tolist()
    n = len(prompts)
    batch = types.PreparedSampleBatch(
        all_prompts=prompts, all_sampling_params=[types.SamplingParams(max_tokens=args.new_tokens, temperature=0.0,
                                                                       stop=[])] * n,
        all_model_ids=["m0"] * n, all_checkpoint_ids=[""] * n, all_checkpoint_paths=[""] * n,
        request_batch_slices=[(f"r{i}", "m0", i, i + 1, False, 0) for i in range(n)])
    backend.sample(batch)  # compile
    with PeakRSS() as rss:
        start = time.perf_counter()
        out = backend.sample(batch)
        elapsed = time.perf_counter() - start
    assert sum(len(s.tokens) for o in out.values() for s in o.sequences) == n * args.new_tokens
    model, stats = backend.model, backend.metrics.sampling
    pools = backend.sampler.paged.device.pools
    positions = pools[0][0].shape[1] * pools[0][0].shape[2]  # pages x page size
    measured = sum(pool.nbytes for stack in pools for pool in stack) // positions
    assert measured == model.kv_bytes_per_token(), (measured, model.kv_bytes_per_token())
    cfg, itemsize = model.config, model.embed_tokens.embedding[...].dtype.itemsize
    layers = cfg.num_hidden_layers
    return {"framework": "tx-paged", "workload": "kv_memory", "family": args.family,
            "shapes": {"family": args.family, "params": params, "hidden": cfg.hidden_size, "layers": layers,
                       "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "head_dim": args.head_dim,
                       "kv_lora_rank": cfg.mla and cfg.mla.kv_lora_rank,
                       "qk_rope_head_dim": cfg.mla and cfg.mla.qk_rope_head_dim, "rows": n,
                       "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "dtype": str(jax.numpy.dtype(
                           model.embed_tokens.embedding[...].dtype))},
            "kv_bytes_per_token_per_layer": measured // layers, "kv_bytes_per_token": measured,
            "transformers_kv_bytes_per_token": hf_kv_bytes_per_token(cfg, itemsize),
            "pools": [[list(pool.shape) for pool in stack] for stack in pools],
            "peak_kv_bytes": stats["peak_pages"] * backend.config.kv_page_size * measured,
            "tokens_per_s": round(n * args.new_tokens / elapsed, 1), "peak_rss_bytes": rss.peak,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # DeepSeek-V2-Lite's attention (hidden 2048, 16 heads of 128 + 64 RoPE dims, a 512 latent) beside a GQA model
    # of that hidden size with 4 kv heads of 128 (Qwen3-1.7B-like), two layers (per-token bytes scale with layers)
    add_model_args(parser, hidden=2048, layers=2, heads=16, kv_heads=4, intermediate=2048, head_dim=128)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    rows = {}
    for family in ("qwen3", "deepseek_v3"):
        args.family = family
        with random_model(args) as (model_dir, params):
            rows[family] = measure(model_dir, params, args)
        print(json.dumps(rows[family]), flush=True)
    mla, gqa = rows["deepseek_v3"], rows["qwen3"]
    print(json.dumps({"workload": "kv_memory", "kv_bytes_per_token_mla_over_gqa":
                      round(mla["kv_bytes_per_token"] / gqa["kv_bytes_per_token"], 4),
                      "mla_over_transformers_mla_cache": round(mla["kv_bytes_per_token"]
                                                               / mla["transformers_kv_bytes_per_token"], 4),
                      "peak_kv_bytes_mla_over_gqa": round(mla["peak_kv_bytes"] / gqa["peak_kv_bytes"], 4)}), flush=True)


if __name__ == "__main__":
    main()
