"""Step g: PyTorch + PEFT on the same device, for the workloads of steps b and d, with tx / torch ratios.

HF `Qwen3ForCausalLM` from the same random checkpoint (bf16 weights, the default SDPA attention, eager: no
torch.compile), PEFT LoRA of the same rank and alpha on the same modules (q/k/v/o, gate/up/down, lm_head;
PEFT keeps adapter weights in float32, as tx does), no gradient checkpointing.

- `lora_train_*`: the rows and adapters of step b. PEFT cannot mix adapters in one batch, so with 8
  adapters each adapter runs forward + backward on its own rows (set_adapter), then AdamW steps each
  adapter's parameters. `step_time_s` is forward + backward (summed over the adapters), optimizer steps are
  `optim_step_s`; medians after warm-up.
- `decode_b*`: `model.generate` (KV cache, greedy, `min_new_tokens` = `max_new_tokens`), prefill = a 1-token
  generation, decode = total - prefill, as step d.

Each line carries `ratio_tx_over_torch_tokens_per_s` from step b's / d's line of the same workload in the
results file (None when that line is missing or failed). Peak device memory is torch's max allocated bytes
(reset per workload).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from suite import (Device, Results, decode_step_bytes, lora_train_flops, lora_shapes, lora_workload, matmul_params, mfu,
                   model_shape, step_args, work)

MODEL = "qwen3_1p7b"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def tx_line(results_path: Path, step: str, workload: str) -> dict | None:
    if not results_path.exists():
        return None
    for line in results_path.read_text().splitlines():
        row = json.loads(line)
        if row.get("step") == step and row.get("workload") == workload and not row.get("error"):
            return row
    return None


def ratio(tx_row: dict | None, key: str, ours: float | None) -> float | None:
    if not tx_row or not tx_row.get(key) or not ours:
        return None
    return round(tx_row[key] / ours, 3)


def load(model_dir: Path, rank: int, adapters: int, device: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # (.to also casts: a transformers release that ignores `dtype=` would otherwise load float32)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device, torch.bfloat16)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
    model = get_peft_model(base, cfg, adapter_name="m0")
    for a in range(1, adapters):
        model.add_adapter(f"m{a}", cfg)
    return model


def train(results: Results, dev: Device, model, m, w: dict, adapters: int, torch_device: str, path: Path) -> None:
    import torch

    name = lora_workload(adapters)
    with results.workload(name) as row:
        rows, seq_len, rank = w["rows"], w["seq_len"], w["rank"]
        tokens = rows * seq_len
        row["shapes"] = lora_shapes(MODEL, m, w, adapters, attention=model.config._attn_implementation)
        model.train()
        owners = [i % adapters for i in range(rows)]
        optimizers = {}
        for a in sorted(set(owners)):
            model.set_adapter(f"m{a}")
            params = [p for n, p in model.named_parameters() if f".m{a}." in n]
            optimizers[a] = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        rng = np.random.default_rng(adapters)
        fb_times, opt_times = [], []
        for i in range(w["warmup"] + w["steps"]):
            batch = torch.tensor(rng.integers(0, m.vocab_size, (rows, seq_len + 1)), device=torch_device)
            fb = opt = 0.0
            for a in sorted(set(owners)):
                model.set_adapter(f"m{a}")
                mine = batch[[j for j, o in enumerate(owners) if o == a]]
                dev.sync()
                start = time.perf_counter()
                logits = model(input_ids=mine[:, :-1]).logits
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                         mine[:, 1:].reshape(-1), reduction="sum")
                loss.backward()
                dev.sync()
                mid = time.perf_counter()
                optimizers[a].step()
                optimizers[a].zero_grad(set_to_none=True)
                dev.sync()
                fb, opt = fb + mid - start, opt + time.perf_counter() - mid
                del logits, loss
            if i >= w["warmup"]:
                fb_times.append(fb)
                opt_times.append(opt)
        fb, opt = statistics.median(fb_times), statistics.median(opt_times)
        flops = lora_train_flops(m, rank, tokens, seq_len)
        tx_row = tx_line(path, "b", name)
        row.update({
            "step_time_s": round(fb, 5), "tokens_per_s": round(tokens / fb, 1), "optim_step_s": round(opt, 5),
            "step_with_optim_s": round(fb + opt, 5), "tokens_per_s_with_optim": round(tokens / (fb + opt), 1),
            "compiles": 0, "model_flops_per_step": flops, "mfu": mfu(flops, fb, dev.peak_flops),
            "mfu_6n": mfu(6 * matmul_params(m) * tokens, fb, dev.peak_flops),
            "ratio_tx_over_torch_tokens_per_s": ratio(tx_row, "tokens_per_s", tokens / fb),
            "ratio_tx_over_torch_tokens_per_s_with_optim": ratio(tx_row, "tokens_per_s_with_optim",
                                                                 tokens / (fb + opt)),
        })
        for a in optimizers:
            optimizers[a].zero_grad(set_to_none=True)


def decode(results: Results, dev: Device, model, m, w: dict, batch: int, torch_device: str, path: Path) -> None:
    import torch

    name = f"decode_b{batch}"
    with results.workload(name) as row:
        plen, new, rank = w["prompt_len"], w["new_tokens"], w["rank"]
        row["shapes"] = {"model": MODEL, **vars(m), "batch": batch, "prompt_len": plen, "new_tokens": new,
                         "rank": rank, "adapters": 1, "dtype": "bfloat16", "engine": "transformers generate",
                         "attention": model.config._attn_implementation}
        model.eval()
        model.set_adapter("m0")
        rng = np.random.default_rng(batch)

        def run(tokens: int) -> float:
            ids = torch.tensor(rng.integers(3, m.vocab_size, (batch, plen)), device=torch_device)
            dev.sync()
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                     min_new_tokens=tokens, do_sample=False, use_cache=True, pad_token_id=0)
            dev.sync()
            elapsed = time.perf_counter() - start
            if out.shape[1] != plen + tokens:
                raise RuntimeError(f"generated {out.shape[1] - plen} tokens per row, expected {tokens}")
            return elapsed

        run(1), run(new)  # warm-up
        prefill = statistics.median(run(1) for _ in range(w["repeats"]))
        total = statistics.median(run(new) for _ in range(w["repeats"]))
        decode_s = total - prefill
        step = decode_s / max(new - 1, 1) if decode_s > 0 else None  # None: lost in the noise (tiny shapes)
        tps = step and batch / step
        bytes_per_step = decode_step_bytes(m, rank, batch, plen + new / 2)
        row.update({
            "step_time_s": step and round(step, 6), "tokens_per_s": tps and round(tps, 1),
            "prefill_s": round(prefill, 5),
            "prefill_tokens_per_s": round(batch * plen / prefill, 1), "total_s": round(total, 5), "compiles": 0,
            "bytes_per_decode_step": int(bytes_per_step),
            "hbm_fraction": round(bytes_per_step / step / dev.peak_bandwidth, 4) if dev.peak_bandwidth and step else None,
            "ratio_tx_over_torch_tokens_per_s": ratio(tx_line(path, "d", name), "tokens_per_s", tps),
        })


def main() -> None:
    args = step_args("g", __doc__.split("\n\n")[0])
    dev = Device("torch")
    results = Results(args.results, "g", args.dry_run, dev)
    wl, wd, m = work(args.dry_run, "lora"), work(args.dry_run, "decode"), model_shape(args.dry_run, MODEL)
    torch_device = "cuda" if dev.cuda else "cpu"
    if not dev.cuda:  # the dry run: on a shared 2-core CPU torch's spinning worker threads cost ~10x
        import torch

        torch.set_num_threads(1)
    model, error = None, None
    try:
        model = load(Path(args.models) / MODEL, wl["rank"], wl["adapters"], torch_device)
    except Exception as exc:  # noqa: BLE001 - every workload reports it
        error = exc
    jobs = [(train, wl, a) for a in (1, wl["adapters"])] + [(decode, wd, b) for b in wd["torch_batches"]]
    for fn, w, n in jobs:
        if error is not None:
            name = lora_workload(n) if fn is train else f"decode_b{n}"
            with results.workload(name):
                raise RuntimeError(f"model load failed: {type(error).__name__}: {error}")
            continue
        fn(results, dev, model, m, w, n, torch_device, Path(args.results))


if __name__ == "__main__":
    main()
