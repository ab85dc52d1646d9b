"""Sampling throughput: tx prefill + decode vs transformers `generate` (KV cache on), same workload, one run.

    python benchmarks/bench_sample.py                                   # defaults sized for a 2-core CPU
    python benchmarks/bench_sample.py --batch-sizes 1 8 64 --prompt-lens 32 128 --new-tokens 64

For each batch size x prompt length: `--new-tokens` greedy tokens per row (stop disabled, so every row
generates exactly that many), with rows on 1 adapter or spread over `--adapters` adapters. The peer is
transformers + PEFT `generate` with `adapter_names` (PEFT's mixed-adapter batch inference). Prefill time
is measured as a 1-token generation; decode tokens/s = rows * (new_tokens - 1) / (total - prefill).
Prints one JSON line per (framework, workload) and a ratio line per workload.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from common import add_model_args, random_model

RANK = 8


def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(batch * 1000 + prompt_len)
    return rng.integers(3, vocab, (batch, prompt_len)).tolist()


class TxRunner:
    name = "tx"

    def __init__(self, model_dir: Path, adapters: int, args):
        import tx
        from tx import types

        self.types = types
        self.backend = tx.JaxBackend(str(model_dir), tx.JaxBackendConfig(
            max_lora_adapters=adapters + 1, max_lora_rank=RANK, max_seq_len=max(args.prompt_lens) + args.new_tokens + 1))
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
        return self.backend.metrics.compiles.get("sample", 0)


class HFRunner:
    name = "transformers+peft"

    def __init__(self, model_dir: Path, adapters: int, args):
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        self.torch = torch
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        cfg = LoraConfig(r=RANK, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj", "lm_head"])
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


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1536)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--skip-peer", action="store_true")
    args = parser.parse_args()

    import jax

    with random_model(args) as (model_dir, params):
        for adapters in (1, args.adapters):
            runners = [TxRunner(model_dir, adapters, args)] + ([] if args.skip_peer else [HFRunner(model_dir, adapters, args)])
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
                        decode = max(total - prefill, 1e-9)
                        row = {
                            "framework": runner.name, "workload": workload,
                            "shapes": {"params": params, "batch": batch, "prompt_len": plen,
                                       "new_tokens": args.new_tokens, "adapters": adapters, "rank": RANK},
                            "prefill_tokens_per_s": round(batch * plen / prefill, 1),
                            "decode_tokens_per_s": round(batch * (args.new_tokens - 1) / decode, 1),
                            "step_time_s": round(decode / max(args.new_tokens - 1, 1), 5),
                            "total_s": round(total, 4), "compiles": runner.compiles(),
                            "device": jax.devices()[0].device_kind if runner.name == "tx" else "cpu",
                        }
                        rows[runner.name] = row
                        print(json.dumps(row), flush=True)
                    if len(rows) == 2:
                        a, b = rows["tx"], rows["transformers+peft"]
                        print(json.dumps({"workload": workload,
                                          "ratio_decode_tx_over_peer": round(a["decode_tokens_per_s"] / b["decode_tokens_per_s"], 3),
                                          "ratio_prefill_tx_over_peer": round(a["prefill_tokens_per_s"] / b["prefill_tokens_per_s"], 3)}),
                              flush=True)


if __name__ == "__main__":
    main()
