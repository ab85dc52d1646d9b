"""Shared by the benchmarks: model-shape flags and a random checkpoint of that shape."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np


def add_model_args(parser: argparse.ArgumentParser, *, hidden: int, layers: int, heads: int, kv_heads: int,
                   intermediate: int, vocab: int = 32000, head_dim: int | None = None) -> None:
    """The model-shape flags; `--head-dim` defaults to hidden / heads unless `head_dim` is given."""
    g = parser.add_argument_group("model shape (a random checkpoint of that family is written for the run)")
    g.add_argument("--family", choices=["qwen3", "llama", "deepseek_v3"], default="qwen3",
                   help="qwen3: Qwen3ForCausalLM (q/k norms); llama: Llama 3's LlamaForCausalLM (no q/k norms, "
                   "Llama 3.1 RoPE scaling); deepseek_v3: DeepseekV3ForCausalLM (latent attention with the --kv-lora-rank "
                   "flags, one dense layer, then 16 experts of intermediate/4 in 4 groups, top-4, one shared expert)")
    g.add_argument("--hidden-size", type=int, default=hidden)
    g.add_argument("--num-layers", type=int, default=layers)
    g.add_argument("--num-heads", type=int, default=heads)
    g.add_argument("--num-kv-heads", type=int, default=kv_heads)
    g.add_argument("--head-dim", type=int, default=head_dim, help="default: hidden size / heads")
    g.add_argument("--intermediate-size", type=int, default=intermediate)
    g.add_argument("--vocab-size", type=int, default=vocab)
    g.add_argument("--kv-lora-rank", type=int, default=512, help="deepseek_v3: the cached latent (DeepSeek-V3's 512)")
    g.add_argument("--qk-rope-head-dim", type=int, default=64, help="deepseek_v3: RoPE dims per head (DeepSeek-V3's 64)")
    g.add_argument("--q-lora-rank", type=int, default=0, help="deepseek_v3: query bottleneck rank (0: one q_proj)")


def model_spec(args: argparse.Namespace, **overrides):
    """The TinySpec of the shape flags in `args` (random weights, std 0.02), with `overrides` applied."""
    from tx.models.tiny import TinySpec

    family = getattr(args, "family", "qwen3")
    fields = dict(family=family, llama3_rope=family == "llama", hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
                  num_kv_heads=args.num_kv_heads, head_dim=args.head_dim or args.hidden_size // args.num_heads,
                  intermediate_size=args.intermediate_size, vocab_size=args.vocab_size, init_std=0.02)
    if family == "deepseek_v3":
        fields |= dict(kv_lora_rank=args.kv_lora_rank, qk_rope_head_dim=args.qk_rope_head_dim, q_lora_rank=args.q_lora_rank,
                       num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                       moe_intermediate_size=max(1, args.intermediate_size // 4))
        overrides.pop("moe", None)  # always MoE
    return TinySpec(**{**fields, **overrides})


@contextlib.contextmanager
def random_model(args: argparse.Namespace) -> Iterator[tuple[Path, int]]:
    """(checkpoint directory, parameter count) of a random model with the shape in `args`."""
    from tx.models.safetensors_io import SafetensorsDir
    from tx.models.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "model", model_spec(args))
        files = SafetensorsDir(model_dir)
        yield model_dir, sum(int(np.prod(files.shape(k))) for k in files.keys())


def timed(fn) -> float:
    """Seconds `fn()` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class PeakRSS:
    """Highest resident memory of this process while the block runs (sampled every 5 ms)."""

    def __enter__(self):
        import psutil

        self._proc, self._stop = psutil.Process(), False
        self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop:
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
