"""tx vs SkyRL's JAX backend (PyPI skyrl==0.4.0, `skyrl.backends.jax.JaxBackend`): LoRA training and sampling.

    bash benchmarks/peer_env.sh                                   # Python 3.12 venv with both engines, one jax
    .venv-peer/bin/python benchmarks/bench_peer.py                # ~100M Qwen3, every workload, both engines
    .venv-peer/bin/python benchmarks/bench_peer.py --quick        # tiny shapes: checks the script works
    .venv-peer/bin/python benchmarks/bench_peer.py --runs 3 --only tx --workloads train sample_b8

Both engines load the same random Qwen3 checkpoint (transformers' `save_pretrained`, float32, untied head;
a small tokenizer next to it, which SkyRL's backend loads at start) and are driven through their backend
API, the one each Tinker server calls: create_model, forward / forward_backward, optim_step, sample.
LoRA rank 16, alpha 32, on attention + MLP (no unembed), gradient checkpointing off in both.

Workloads, each (engine, run) in its own process so memory peaks and compile caches do not mix:
  train_1ad, train_<N>ad  `--batch` rows x `--seq-len` tokens of cross-entropy, on 1 adapter or spread over
                          `--adapters`; one step = forward_backward + an optim_step per adapter present;
                          tokens/s of the median step after `--warmup` steps.
  sample_b<B>             B prompts of `--prompt-len` tokens, `--new-tokens` greedy tokens each through an
                          adapter, stop disabled; generated tokens/s of the median of `--sample-iters` calls,
                          each on new prompts after a warm-up call (`--repeat-prompts`: the warm-up's again).
  sample_rl               `--rl-prompts` prompts x `--rl-samples` samples (T = 1, seeded), max_tokens per
                          prompt drawn in `--rl-max-tokens`; one call, after a warm-up call on other prompts.
tx samples with its default (paged) engine, for sample_rl with a decode slot per row; SkyRL decodes a call
as one padded batch and samples an adapter from a sampler checkpoint, saved once (its Tinker flow).
`--tx-config` / `--skyrl-config` (JSON) override either backend's config fields. `--tx-source DIR` runs the tx
of an older commit (`git archive <rev> tx | tar -x -C DIR`; PYTHONPATH alone would not: an editable install's
import hook comes first), e.g. the issue's RL comparison with 756636f: `--only tx --workloads sample_rl`, once
with `--tx-source` and once without.
Cross-checks (first run of each): per-row log-prob sums of a forward pass on the first training batch
(adapters are fresh: B = 0 in both engines) agree to `--rtol`, and greedy tokens are identical.
Runs alternate between the engines (tx, SkyRL, tx, ...). Prints one JSON line per (workload, engine) (medians
over `--runs`), a ratio line tx/skyrl (with each tx run over the SkyRL run after it), check lines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import add_model_args

RANK, ALPHA = 16, 32.0
ENGINES = ("tx", "skyrl")
QUICK = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
             vocab_size=1024, batch=2, seq_len=16, adapters=2, warmup=1, steps=2, sample_batches=[1, 4],
             prompt_len=16, new_tokens=4, sample_iters=1, rl_prompts=2, rl_samples=2, rl_prompt_len=16,
             rl_max_tokens=[2, 8])


# ---- the checkpoint ----

def write_checkpoint(out: Path, args: argparse.Namespace) -> int:
    """A random Qwen3 written by transformers, plus a tokenizer; returns the parameter count."""
    import torch
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tx.models.tiny_tokenizer import build_tokenizer

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                      intermediate_size=args.intermediate_size, num_attention_heads=args.num_heads,
                      num_key_value_heads=args.num_kv_heads, head_dim=args.head_dim, max_position_embeddings=4096,
                      tie_word_embeddings=False, dtype="float32")
    model = Qwen3ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out)
    build_tokenizer(out)  # SkyRL's backend loads one at start; tx only for stop strings
    return sum(p.numel() for p in model.parameters())


# ---- the two engines behind one interface ----

def pass_slices(owners: list[int]) -> list[tuple[str, str, int, int]]:
    """One request per row, on adapter m<owner>."""
    return [(f"r{j}", f"m{a}", j, j + 1) for j, a in enumerate(owners)]


def sample_slices(n: int, k: int) -> list[tuple[str, str, int, int, bool, int]]:
    """n requests of k samples each, on adapter m0, no prompt log-probs."""
    return [(f"r{i}", "m0", i * k, (i + 1) * k, False, 0) for i in range(n)]


class Engine:
    """What both engines share: their types module `t` names these fields alike."""

    t: Any
    backend: Any

    def add_adapters(self, adapters: int) -> None:
        for a in range(adapters):
            self.backend.create_model(f"m{a}", self.t.LoraConfig(rank=RANK, alpha=ALPHA, seed=a, train_unembed=False))

    def optim_step(self, model_id: str) -> None:
        adam = self.t.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
        self.backend.optim_step(model_id, self.t.OptimStepInput(adam_params=adam))


class TxEngine(Engine):
    def __init__(self, model_dir: str, adapters: int, max_seq_len: int, extra: dict):
        import tx
        from tx import types

        self.t = types
        cfg = dict(max_lora_adapters=adapters + 1, max_lora_rank=RANK, max_seq_len=max_seq_len,
                   gradient_checkpointing=False) | extra
        self.backend = tx.JaxBackend(model_dir, tx.JaxBackendConfig(**cfg))
        self.add_adapters(adapters)

    def pass_batch(self, rows: list[list[int]], owners: list[int]):
        n = len(rows)
        return self.t.PreparedModelPassBatch(
            all_input_ids=[r[:-1] for r in rows], all_targets=[r[1:] for r in rows],
            all_token_weights=[[1.0] * (len(r) - 1) for r in rows], all_sampling_logprobs=[[]] * n,
            all_advantages=[[]] * n, all_model_ids=[f"m{a}" for a in owners], all_loss_fns=["cross_entropy"] * n,
            all_loss_fn_configs=[None] * n, request_batch_slices=pass_slices(owners))

    def sample_batch(self, prompts: list[list[int]], k: int, max_tokens: list[int], temperature: float):
        t, n = self.t, len(prompts)
        # sample j of request i: seed i * k + j (tx adds j itself)
        params = [t.SamplingParams(max_tokens=m, temperature=temperature, seed=i * k, stop=[])
                  for i, m in enumerate(max_tokens)]
        return t.PreparedSampleBatch(
            all_prompts=[p for p in prompts for _ in range(k)],
            all_sampling_params=[p for p in params for _ in range(k)],
            all_model_ids=["m0"] * n * k, all_checkpoint_ids=[""] * n * k, all_checkpoint_paths=[""] * n * k,
            request_batch_slices=sample_slices(n, k))


class SkyrlEngine(Engine):
    def __init__(self, model_dir: str, adapters: int, max_seq_len: int, extra: dict):
        from skyrl.backends.jax import JaxBackend, JaxBackendConfig
        from skyrl.tinker import types

        self.t = types
        cfg = dict(max_lora_adapters=adapters + 1, max_lora_rank=RANK, gradient_checkpointing=False) | extra
        self.backend = JaxBackend(model_dir, JaxBackendConfig(**cfg))
        self.add_adapters(adapters)
        self._sampler_path = ""

    def pass_batch(self, rows: list[list[int]], owners: list[int]):
        t, n = self.t, len(rows)
        return t.PreparedModelPassBatch(
            all_model_inputs=[t.ModelInput(chunks=[t.EncodedTextChunk(tokens=r[:-1])]) for r in rows],
            all_targets=[r[1:] for r in rows], all_token_weights=[[1.0] * (len(r) - 1) for r in rows],
            all_sampling_logprobs=[[]] * n, all_advantages=[[]] * n, all_values=[[]] * n, all_returns=[[]] * n,
            all_model_ids=[f"m{a}" for a in owners], all_loss_fns=["cross_entropy"] * n,
            all_loss_fn_configs=[None] * n, request_batch_slices=pass_slices(owners))

    def sample_batch(self, prompts: list[list[int]], k: int, max_tokens: list[int], temperature: float):
        from cloudpathlib import AnyPath

        t, n = self.t, len(prompts)
        if not self._sampler_path:
            # SkyRL samples an adapter only from a saved sampler checkpoint (its Tinker flow): the first
            # sample call loads it, later calls find it loaded
            self._sampler_path = str(Path(tempfile.mkdtemp()) / "m0.tar.gz")
            self.backend.save_sampler_checkpoint(AnyPath(self._sampler_path), "m0")
        # the Tinker engine expands num_samples into rows of seed + sample index; so do we
        params = [t.SamplingParams(max_tokens=m, temperature=temperature, seed=i * k + j)
                  for i, m in enumerate(max_tokens) for j in range(k)]
        return t.PreparedSampleBatch(
            all_model_inputs=[t.ModelInput(chunks=[t.EncodedTextChunk(tokens=p)]) for p in prompts for _ in range(k)],
            all_sampling_params=params, all_model_ids=["m0"] * n * k, all_checkpoint_ids=["bench"] * n * k,
            all_checkpoint_paths=[self._sampler_path] * n * k, all_session_ids=[None] * n * k,
            needs_prompt_logprobs=False, request_batch_slices=sample_slices(n, k))


def peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM, not ru_maxrss: Linux carries the forking parent's peak
    across exec into ru_maxrss, and the parent here holds torch and the checkpoint writer."""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _data(x) -> list[float]:
    """A TensorData's values: tx returns the model, SkyRL a plain dict."""
    return x.data if hasattr(x, "data") else x["data"]


def _tokens(out: dict, n: int) -> list[list[int]]:
    """Generated tokens of requests r0..r{n-1}, their samples in order."""
    return [s.tokens for i in range(n) for s in out[f"r{i}"].sequences]


# ---- workloads (run in the child process) ----

def train_rows(args: argparse.Namespace, step: int) -> list[list[int]]:
    """Step `step`'s token rows (seq_len + 1 each: inputs and shifted targets)."""
    rng = np.random.default_rng(step)
    return rng.integers(0, args.vocab_size, (args.batch, args.seq_len + 1)).tolist()


def run_train(engine: Engine, args: argparse.Namespace, adapters: int) -> dict:
    owners = [i % adapters for i in range(args.batch)]
    rows0 = train_rows(args, 0)
    out = engine.backend.forward(engine.pass_batch(rows0, owners))  # the cross-check, before any update
    sums = [float(np.sum(_data(out[f"r{j}"].loss_fn_outputs[0]["logprobs"]))) for j in range(args.batch)]
    times = []
    for step in range(args.warmup + args.steps):
        batch = engine.pass_batch(train_rows(args, step), owners)
        start = time.perf_counter()
        engine.backend.forward_backward(batch)
        for a in sorted(set(owners)):
            engine.optim_step(f"m{a}")
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[args.warmup:])
    return {"tokens_per_s": args.batch * args.seq_len / step_s, "step_time_s": step_s,
            "warmup_s": sum(times[:args.warmup]), "logprob_sums": sums}


def run_sample(engine: Engine, args: argparse.Namespace, batch: int) -> dict:
    rng = np.random.default_rng(batch)
    # one call to compile (SkyRL: also loads the sampler checkpoint), then each timed call on prompts new to the
    # engine (tx's prefix cache would hold a repeated prompt's pages: a user's next request rarely repeats one);
    # `--repeat-prompts` times the warm-up's prompts again (the tables before 2026-11-29 did)
    calls = [rng.integers(3, args.vocab_size, (batch, args.prompt_len)).tolist()
             for _ in range(1 if args.repeat_prompts else args.sample_iters + 1)]
    requests = [engine.sample_batch(p, 1, [args.new_tokens] * batch, 0.0) for p in calls]
    start = time.perf_counter()
    engine.backend.sample(requests[0])
    warm = time.perf_counter() - start
    times, tokens = [], []
    for i in range(args.sample_iters):
        start = time.perf_counter()
        out = engine.backend.sample(requests[0 if args.repeat_prompts else i + 1])
        times.append(time.perf_counter() - start)
        tokens += _tokens(out, batch)
    assert all(len(t) == args.new_tokens for t in tokens), [len(t) for t in tokens]
    call_s = statistics.median(times)
    return {"tokens_per_s": batch * args.new_tokens / call_s, "step_time_s": call_s, "warmup_s": warm, "tokens": tokens}


def run_rl(engine: Engine, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    n, k, plen = args.rl_prompts, args.rl_samples, args.rl_prompt_len
    max_tokens = rng.integers(args.rl_max_tokens[0], args.rl_max_tokens[1] + 1, n).tolist()
    # warm up on other prompts of the same shapes: the timed prompts are new to tx's prefix cache, as a new
    # RL step's are; same max_tokens, so SkyRL's decode loop (compiled per max length) is reused
    warm = engine.sample_batch(rng.integers(3, args.vocab_size, (n, plen)).tolist(), k, max_tokens, 1.0)
    req = engine.sample_batch(rng.integers(3, args.vocab_size, (n, plen)).tolist(), k, max_tokens, 1.0)
    start = time.perf_counter()
    engine.backend.sample(warm)
    warm_s = time.perf_counter() - start
    start = time.perf_counter()
    out = engine.backend.sample(req)
    call_s = time.perf_counter() - start
    generated = sum(len(t) for t in _tokens(out, n))
    assert generated == k * sum(max_tokens), (generated, k * sum(max_tokens))
    return {"tokens_per_s": generated / call_s, "step_time_s": call_s, "warmup_s": warm_s}


def workload_shapes(name: str, args: argparse.Namespace) -> dict:
    model = {"hidden": args.hidden_size, "layers": args.num_layers, "heads": args.num_heads,
             "kv_heads": args.num_kv_heads, "head_dim": args.head_dim, "intermediate": args.intermediate_size,
             "vocab": args.vocab_size, "rank": RANK, "dtype": "float32"}
    if name.startswith("train_"):
        return model | {"batch": args.batch, "seq_len": args.seq_len, "adapters": int(name[6:-2])}
    if name == "sample_rl":
        return model | {"prompts": args.rl_prompts, "samples": args.rl_samples, "prompt_len": args.rl_prompt_len,
                        "max_tokens": args.rl_max_tokens, "temperature": 1.0}
    return model | {"batch": int(name[8:]), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                    "greedy": True, "repeat_prompts": args.repeat_prompts}


def use_tx_source(folder: str) -> None:
    """Import tx from `folder` (e.g. `git archive <rev> tx | tar -x -C folder`) instead of the installed tx. An
    editable install's import hook comes before PYTHONPATH and sys.path, so setting those alone would still
    run the working tree's tx: the hook is removed first."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in f"{getattr(f, '__module__', '')} {f!r}"]
    sys.path.insert(0, str(Path(folder).resolve()))


def source_commit(folder: str) -> str | None:
    """The git commit `folder` is checked out at, "+dirty" when its tracked files differ from it; None outside
    git's tracked files (a `--tx-source` folder from `git archive`: its path names the commit)."""
    def git(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", folder, *cmd], capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode or not git("ls-files", "--", ".").stdout.strip():  # not tracked: e.g. an archive inside a repo
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".").stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


def child(spec: dict) -> None:
    """Run one workload on one engine; print its result as a `RESULT {json}` line."""
    args = argparse.Namespace(**spec["args"])
    name, engine_name = spec["workload"], spec["engine"]
    import jax

    if name.startswith("train_"):
        adapters, seq = int(name[6:-2]), args.seq_len + 1
        extra = {}
    elif name == "sample_rl":
        adapters, seq = 1, args.rl_prompt_len + args.rl_max_tokens[1] + 1
        # every row decodes at once, as SkyRL's single padded batch does
        extra = {"max_num_seqs": args.rl_prompts * args.rl_samples} if engine_name == "tx" else {}
    else:
        adapters, seq, extra = 1, args.prompt_len + args.new_tokens + 1, {}
    extra |= json.loads(args.tx_config if engine_name == "tx" else args.skyrl_config)
    if engine_name == "tx":
        if args.tx_source:
            use_tx_source(args.tx_source)
        import tx  # imports first, so import_rss_mb separates them from the engine's memory

        tx_package = str(Path(tx.__file__).parent)
    else:
        import skyrl.backends.jax  # noqa: F401
    import_rss = peak_rss_mb()
    engine = (TxEngine if engine_name == "tx" else SkyrlEngine)(spec["model_dir"], adapters, seq, extra)
    settings = engine.backend.config.model_dump(exclude_defaults=True)
    if engine_name == "tx":
        settings["tx_package"] = tx_package  # which tx ran (--tx-source)
        settings["tx_commit"] = source_commit(tx_package)
    for logger in ("tx", "skyrl"):  # per-step INFO lines would be timed too
        logging.getLogger(logger).setLevel(logging.WARNING)
    if name.startswith("train_"):
        result = run_train(engine, args, adapters)
    elif name == "sample_rl":
        result = run_rl(engine, args)
    else:
        result = run_sample(engine, args, int(name[8:]))
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    result |= {"peak_rss_mb": peak_rss_mb(), "import_rss_mb": import_rss,
               "device_peak_mb": stats["peak_bytes_in_use"] / 2**20 if "peak_bytes_in_use" in stats else None,
               "jax": jax.__version__, "device": f"{dev.platform}:{dev.device_kind}", "engine_config": settings}
    print("RESULT " + json.dumps(result), flush=True)


# ---- the parent: spawn, aggregate, compare ----

def spawn(spec: dict, timeout: float) -> dict:
    """The child's result, or {"error": ..., "log_tail": [...]}."""
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timeout after {timeout:.0f} s", "log_tail": str(e.stderr or "")[-2000:].splitlines()}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        return {"error": f"exit {proc.returncode}", "log_tail": tail}
    return json.loads(lines[-1][len("RESULT "):])


def aggregate(name: str, engine: str, runs: list[dict], args: argparse.Namespace, params: int) -> dict:
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    row = {"workload": name, "engine": engine, "shapes": workload_shapes(name, args) | {"params": params},
           "tokens_per_s": round(med("tokens_per_s"), 2), "step_time_s": round(med("step_time_s"), 5),
           "warmup_s": round(med("warmup_s"), 2), "peak_rss_mb": round(med("peak_rss_mb"), 1),
           "import_rss_mb": round(med("import_rss_mb"), 1),
           "device_peak_mb": runs[0]["device_peak_mb"] and round(med("device_peak_mb"), 1),
           "jax": runs[0]["jax"], "device": runs[0]["device"], "runs": len(runs),
           "engine_config": runs[0]["engine_config"]}
    if len(runs) > 1:
        row["tokens_per_s_runs"] = [round(r["tokens_per_s"], 2) for r in runs]
    return row


def cross_check(name: str, first: dict[str, dict], rtol: float) -> dict | None:
    tx_run, peer = first.get("tx"), first.get("skyrl")
    if not tx_run or not peer:
        return None
    if "logprob_sums" in tx_run:
        a, b = np.array(tx_run["logprob_sums"]), np.array(peer["logprob_sums"])
        rel = np.abs(a - b) / np.maximum(np.maximum(np.abs(a), np.abs(b)), 1e-30)
        return {"check": "forward_logprob_sums", "workload": name, "ok": bool(rel.max() <= rtol),
                "max_rel_diff": float(rel.max()), "max_abs_diff": float(np.abs(a - b).max()), "rtol": rtol,
                "tx": [round(x, 4) for x in a[:4]], "skyrl": [round(x, 4) for x in b[:4]]}
    if "tokens" in tx_run:
        same = [x == y for x, y in zip(tx_run["tokens"], peer["tokens"])]
        bad = same.index(False) if not all(same) else None
        return {"check": "greedy_tokens", "workload": name, "ok": all(same),
                "rows_identical": f"{sum(same)}/{len(same)}",
                "first_mismatch": None if bad is None else {"row": bad, "tx": tx_run["tokens"][bad],
                                                           "skyrl": peer["tokens"][bad]}}
    return None


def run_workload(name: str, engines: list[str], model_dir: str, args: argparse.Namespace, params: int) -> bool:
    """Print the workload's lines (per engine, ratio, cross-check); False if a run or the check failed."""
    rows, first, ok = {}, {}, True
    # runs alternate between the engines (tx, SkyRL, tx, ...): this VM drifts over minutes, and all of one
    # engine's runs before the other's would put that drift into the ratio
    results: dict[str, list[dict]] = {engine: [] for engine in engines}
    for _ in range(args.runs):
        for engine in engines:
            spec = {"workload": name, "engine": engine, "model_dir": model_dir, "args": vars(args)}
            results[engine].append(spawn(spec, args.timeout))
    for engine, runs in results.items():
        good = [r for r in runs if "error" not in r]
        if len(good) < len(runs):
            ok = False
            print(json.dumps({"workload": name, "engine": engine, **next(r for r in runs if "error" in r)}), flush=True)
        if good:
            first[engine] = good[0]
            rows[engine] = aggregate(name, engine, good, args, params)
            print(json.dumps(rows[engine]), flush=True)
    if len(rows) == 2:
        tx_row, peer = rows["tx"], rows["skyrl"]
        ratio = {"workload": name,
                 "ratio_tx_over_skyrl_tokens_per_s": round(tx_row["tokens_per_s"] / peer["tokens_per_s"], 3),
                 "ratio_tx_over_skyrl_peak_rss": round(tx_row["peak_rss_mb"] / peer["peak_rss_mb"], 3)}
        pairs = [(a, b) for a, b in zip(results["tx"], results["skyrl"]) if "error" not in a and "error" not in b]
        if len(pairs) > 1:  # each tx run over the SkyRL run right after it
            ratio["ratio_paired_runs"] = [round(a["tokens_per_s"] / b["tokens_per_s"], 3) for a, b in pairs]
            ratio["ratio_paired_median"] = round(statistics.median(ratio["ratio_paired_runs"]), 3)
        print(json.dumps(ratio), flush=True)
    check = cross_check(name, first, args.rtol)
    if check:
        ok &= check["ok"]
        print(json.dumps(check), flush=True)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser, hidden=768, layers=8, heads=12, kv_heads=4, intermediate=2048, head_dim=64)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, to check the script works")
    parser.add_argument("--runs", type=int, default=1, help="processes per (workload, engine); medians reported")
    parser.add_argument("--only", choices=ENGINES)
    parser.add_argument("--workloads", nargs="+", help="names or prefixes: train, train_1ad, sample, sample_b8, "
                        "sample_rl (default: all)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured training steps (compiles)")
    parser.add_argument("--steps", type=int, default=5, help="measured training steps")
    parser.add_argument("--sample-batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--sample-iters", type=int, default=3, help="measured sample calls (after one warm-up)")
    parser.add_argument("--repeat-prompts", action="store_true", help="sample_b*: time the warm-up call's prompts "
                        "again (tx's prefix cache then holds their full pages) instead of new prompts per call")
    parser.add_argument("--rl-prompts", type=int, default=32)
    parser.add_argument("--rl-samples", type=int, default=16)
    parser.add_argument("--rl-prompt-len", type=int, default=128)
    parser.add_argument("--rl-max-tokens", type=int, nargs=2, default=[16, 256])
    parser.add_argument("--rtol", type=float, default=1e-3, help="log-prob sums: relative tolerance")
    parser.add_argument("--tx-config", default="{}", help="JSON of tx JaxBackendConfig fields to override")
    parser.add_argument("--tx-source", help="run tx from this folder (holding a `tx` package, e.g. `git archive "
                        "<rev> tx | tar -x -C DIR`) instead of the installed one: an older commit side by side; "
                        "its engine_config.tx_package says which ran")
    parser.add_argument("--skyrl-config", default="{}", help="JSON of SkyRL JaxBackendConfig fields to override")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)

    names = ["train_1ad", f"train_{args.adapters}ad"] + [f"sample_b{b}" for b in args.sample_batches] + ["sample_rl"]
    if args.workloads:
        names = [n for n in names if any(n == w or n.startswith(w + "_") for w in args.workloads)]
    engines = [args.only] if args.only else list(ENGINES)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        params = write_checkpoint(model_dir, args)
        for name in dict.fromkeys(names):  # train_1ad twice when --adapters 1
            failed |= not run_workload(name, engines, str(model_dir), args, params)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
