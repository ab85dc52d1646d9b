"""Sampling throughput: tx prefill + decode vs transformers `generate` (KV cache on), same workload, one run.

    python benchmarks/bench_sample.py                                   # defaults sized for a 2-core CPU
    python benchmarks/bench_sample.py --batch-sizes 1 8 64 --prompt-lens 32 128 --new-tokens 64

For each batch size x prompt length: `--new-tokens` greedy tokens per row (stop disabled, so every row
generates exactly that many), with rows on 1 adapter or spread over `--adapters` adapters. The peer is
transformers + PEFT `generate` with `adapter_names` (PEFT's mixed-adapter batch inference). Prefill time
is measured as a 1-token generation; decode tokens/s = rows * (new_tokens - 1) / (total - prefill).
Prints one JSON line per (framework, workload) and a ratio line per workload.

`--workload rl`: an RL sampling load through `backend.sample` in one call: `--rl-prompts` prompts of
`--rl-prompt-len` tokens, `--rl-samples` samples each (T = 1, seeded, no stop), `max_tokens` drawn per
request uniformly in [16, 256]; tx's paged engine (shared prompt prefill, continuous batching) and
transformers + PEFT `generate(num_return_sequences=...)` per prompt. tx runs the workload twice and reports
the second (warm) run. Reports generated tokens/s, prefill tokens computed, peak KV-cache bytes and the
process's peak RSS during the timed run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from common import PeakRSS, add_model_args, random_model, timed

RANK = 8


def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(batch * 1000 + prompt_len)
    return rng.integers(3, vocab, (batch, prompt_len)).tolist()


class TxRunner:
    name = "tx-paged"  # the name earlier results carry (there was a "tx-static" engine too)

    def __init__(self, model_dir: Path, adapters: int, args):
        import tx
        from tx import types

        self.types = types
        self.backend = tx.JaxBackend(str(model_dir), tx.JaxBackendConfig(
            max_lora_adapters=adapters + 1, max_lora_rank=RANK,
            max_seq_len=max(args.prompt_lens) + args.new_tokens + 1))
        for a in range(adapters):
            self.backend.create_model(f"m{a}", types.LoraConfig(rank=RANK, seed=a))
        self.adapters = adapters

    def run(self, prompts: list[list[int]], new_tokens: int) -> None:
        t = self.types
        n = len(prompts)
        params = t.SamplingParams(max_tokens=new_tokens, temperature=0.0, stop=[])
        models = [f"m{i % self.adapters}" for i in range(n)]
        batch = t.PreparedSampleBatch(
            all_prompts=prompts, all_sampling_params=[params] * n, all_model_ids=models,
            all_checkpoint_ids=[""] * n, all_checkpoint_paths=[""] * n,
            request_batch_slices=[(f"r{i}", models[i], i, i + 1, False, 0) for i in range(n)])
        out = self.backend.sample(batch)
        assert all(len(o.sequences[0].tokens) == new_tokens for o in out.values())

    def compiles(self) -> int:
        return sum(v for k, v in self.backend.metrics.compiles.items() if k.startswith("sample"))


class HFRunner:
    name = "transformers+peft"

    def __init__(self, model_dir: Path, adapters: int, args):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        self.torch = torch
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        cfg = LoraConfig(r=RANK, lora_alpha=32, target_modules=peft_targets(args.family))
        self.model = get_peft_model(base, cfg, adapter_name="m0")
        for a in range(1, adapters):
            self.model.add_adapter(f"m{a}", cfg)
        self.model.eval()
        self.adapters = adapters

    def run(self, prompts: list[list[int]], new_tokens: int) -> None:
        ids = self.torch.tensor(prompts)
        names = [f"m{i % self.adapters}" for i in range(len(prompts))]
        with self.torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0,
                                      adapter_names=names)
        assert out.shape[1] == ids.shape[1] + new_tokens

    def compiles(self) -> int:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1536)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--workload", choices=["grid", "rl"], default="grid")
    parser.add_argument("--rl-prompts", type=int, default=32)
    parser.add_argument("--rl-samples", type=int, default=16)
    parser.add_argument("--rl-prompt-len", type=int, default=512)
    parser.add_argument("--rl-max-tokens", type=int, nargs=2, default=[16, 256], help="max_tokens range per request")
    args = parser.parse_args()

    import jax

    if args.workload == "rl":
        with random_model(args) as (model_dir, params):
            rl_workload(model_dir, params, args)
        return
    with random_model(args) as (model_dir, params):
        for adapters in (1, args.adapters):
            runners = [TxRunner(model_dir, adapters, args)]
            runners += [] if args.skip_peer else [HFRunner(model_dir, adapters, args)]
            for batch in args.batch_sizes:
                for plen in args.prompt_lens:
                    prompts = prompts_for(batch, plen, args.vocab_size)
                    workload = f"sample_b{batch}_p{plen}_n{args.new_tokens}_{adapters}ad"
                    rows = {}
                    for runner in runners:
                        runner.run(prompts, 1)  # warm up / compile both programs
                        runner.run(prompts, args.new_tokens)
                        prefill = timed(lambda: runner.run(prompts, 1))
                        total = timed(lambda: runner.run(prompts, args.new_tokens))
                        decode = total - prefill  # <= 0: within timing noise of the prefill (tiny shapes)
                        row = {
                            "framework": runner.name, "workload": workload,
                            "shapes": {"family": args.family, "params": params, "batch": batch, "prompt_len": plen,
                                       "new_tokens": args.new_tokens, "adapters": adapters, "rank": RANK},
                            "prefill_tokens_per_s": round(batch * plen / prefill, 1),
                            "decode_tokens_per_s": round(batch * (args.new_tokens - 1) / decode, 1) if decode > 0
                            else None,
                            "step_time_s": round(max(decode, 0.0) / max(args.new_tokens - 1, 1), 5),
                            "total_s": round(total, 4), "compiles": runner.compiles(),
                            "device": jax.devices()[0].device_kind if runner.name.startswith("tx") else "cpu",
                        }
                        rows[runner.name] = row
                        print(json.dumps(row), flush=True)
                    for name in [n for n in rows if n.startswith("tx")] if "transformers+peft" in rows else []:
                        a, b = rows[name], rows["transformers+peft"]
                        print(json.dumps({"workload": workload, "engine": name,
                                          "ratio_decode_tx_over_peer": round(a["decode_tokens_per_s"] / b["decode_tokens_per_s"], 3),
                                          "ratio_prefill_tx_over_peer": round(a["prefill_tokens_per_s"] / b["prefill_tokens_per_s"], 3)}),
                              flush=True)


def hf_kv_bytes_per_token(cfg, itemsize: int) -> int:
    """Bytes transformers' cache holds per token: K and V per kv head; DeepSeek-V3's holds every head's expanded
    key (qk_nope + qk_rope dims) and value."""
    if cfg.mla is not None:
        return cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim) * itemsize
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize


def peft_targets(family: str) -> list[str]:
    """PEFT's target modules for tx's default LoRA (every linear and the LM head) of the family."""
    attention = (["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] if family == "deepseek_v3"
                 else ["q_proj", "k_proj", "v_proj", "o_proj"])
    return attention + ["gate_proj", "up_proj", "down_proj", "lm_head"]


def rl_workload(model_dir: Path, params: int, args) -> None:
    import jax

    import tx
    from tx import types

    rng = np.random.default_rng(0)
    n, k, plen = args.rl_prompts, args.rl_samples, args.rl_prompt_len
    max_tokens = rng.integers(args.rl_max_tokens[0], args.rl_max_tokens[1] + 1, n).tolist()
    generated = k * sum(max_tokens)
    shapes = {"family": args.family, "params": params, "prompts": n, "samples": k, "prompt_len": plen,
              "max_tokens": args.rl_max_tokens,
              "rank": RANK, "hidden": args.hidden_size, "layers": args.num_layers, "vocab": args.vocab_size}

    def rl_batch(prompts):
        return types.PreparedSampleBatch(
            all_prompts=[p for p in prompts for _ in range(k)],
            all_sampling_params=[types.SamplingParams(max_tokens=m, temperature=1.0, seed=i, stop=[])
                                 for i, m in enumerate(max_tokens) for _ in range(k)],
            all_model_ids=["m0"] * n * k, all_checkpoint_ids=[""] * n * k, all_checkpoint_paths=[""] * n * k,
            request_batch_slices=[(f"r{i}", "m0", i * k, (i + 1) * k, False, 0) for i in range(n)])

    # the warm-up (compiling) run samples other prompts of the same shapes: the timed run's prompts are new
    # to the prefix cache, as a new RL step's are
    warm = rl_batch(rng.integers(3, args.vocab_size, (n, plen)).tolist())
    prompts = rng.integers(3, args.vocab_size, (n, plen)).tolist()
    batch = rl_batch(prompts)
    rows = {}
    backend = tx.JaxBackend(str(model_dir), tx.JaxBackendConfig(
        max_lora_adapters=2, max_lora_rank=RANK, max_seq_len=plen + args.rl_max_tokens[1] + 1, max_num_samples=k))
    backend.create_model("m0", types.LoraConfig(rank=RANK, seed=0))
    token_bytes = backend.model.kv_bytes_per_token()  # what the paged cache holds per token (MLA: the latent)
    peer_token_bytes = hf_kv_bytes_per_token(backend.model.config, backend.model.embed_tokens.embedding[...].dtype.itemsize)
    backend.sample(warm)  # compile
    before = dict(backend.metrics.sampling)
    with PeakRSS() as rss:
        start = time.perf_counter()
        out = backend.sample(batch)
        elapsed = time.perf_counter() - start
    assert sum(len(s.tokens) for o in out.values() for s in o.sequences) == generated
    stats = backend.metrics.sampling
    # prompt tokens prefilled in the timed run, plus each row's last prompt token (its first decode input)
    prefill = stats["prefill_tokens"] - before["prefill_tokens"] + n * k
    rows["paged"] = {"framework": "tx-paged", "workload": "sample_rl", "shapes": shapes,
                     "tokens_per_s": round(generated / elapsed, 1), "total_s": round(elapsed, 3),
                     "prefill_tokens_computed": prefill,
                     "peak_kv_bytes": stats["peak_pages"] * backend.config.kv_page_size * token_bytes,
                     "peak_rss_bytes": rss.peak,
                     "compiles": sum(v for key, v in backend.metrics.compiles.items() if key.startswith("sample")),
                     "device": jax.devices()[0].device_kind, "preempted": stats["preempted"] - before["preempted"],
                     "prefill_tokens_cached": stats["prefill_tokens_cached"] - before["prefill_tokens_cached"]}
    print(json.dumps(rows["paged"]), flush=True)
    del backend
    if not args.skip_peer:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=32, target_modules=peft_targets(args.family))).eval()
        torch.manual_seed(0)
        with PeakRSS() as rss, torch.no_grad():
            start = time.perf_counter()
            for p, m in zip(prompts, max_tokens):
                ids = torch.tensor([p])
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, min_new_tokens=m,
                               do_sample=True, num_return_sequences=k, pad_token_id=0, use_cache=True)
            elapsed = time.perf_counter() - start
        rows["peer"] = {"framework": "transformers+peft", "workload": "sample_rl", "shapes": shapes,
                        "tokens_per_s": round(generated / elapsed, 1), "total_s": round(elapsed, 3),
                        "prefill_tokens_computed": n * k * plen,
                        "peak_kv_bytes": k * (plen + args.rl_max_tokens[1]) * peer_token_bytes, "peak_rss_bytes": rss.peak,
                        "device": "cpu"}
        print(json.dumps(rows["peer"]), flush=True)
    if "peer" in rows:
        ratio = round(rows["paged"]["tokens_per_s"] / rows["peer"]["tokens_per_s"], 3)
        print(json.dumps({"workload": "sample_rl", "tokens_per_s_paged_over_peer": ratio}), flush=True)


if __name__ == "__main__":
    main()
