"""Host memory of exporting a full model as HF safetensors (`tx.checkpoints.full.export_hf_model`).

    python benchmarks/bench_export_memory.py                 # hidden 1024, vocab 151936, 2 layers, float32
    python benchmarks/bench_export_memory.py --dtype bfloat16 --chunk-mb 64

On CPU the model itself lives in host memory, so the number that matters is the peak RSS during the export
minus the RSS before it: what the export adds on top of the live model (gathered blocks, their transposed
copies, the file writer), next to the size of the model and of its largest tensor. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import PeakRSS, add_model_args, model_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=1024, layers=2, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
                   vocab=151936)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--chunk-mb", type=int, default=256, help="largest block gathered at once (MiB)")
    args = parser.parse_args()

    import jax
    from flax import nnx

    from tx.checkpoints.full import BASE_WEIGHTS, export_hf_model
    from tx.models.config import LoraSlots
    from tx.models.loading import load_model
    from tx.models.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        base = write_tiny_model(Path(tmp) / "base", model_spec(args, dtype=args.dtype))
        model = load_model(base, LoraSlots(max_lora_adapters=1, max_lora_rank=1))
        sizes = [x.nbytes for x in jax.tree.leaves(nnx.state(model, BASE_WEIGHTS))]
        with PeakRSS() as before:
            pass
        start = time.perf_counter()
        with PeakRSS() as during:
            export_hf_model(Path(tmp) / "out", model, base, chunk_bytes=args.chunk_mb * 2**20)
        seconds = time.perf_counter() - start
    mib = 2**20
    print(json.dumps({
        "shape": {k: getattr(args, k) for k in ("hidden_size", "num_layers", "vocab_size", "intermediate_size")},
        "dtype": args.dtype, "chunk_mib": args.chunk_mb, "model_mib": round(sum(sizes) / mib, 1),
        "largest_tensor_mib": round(max(sizes) / mib, 1), "rss_before_mib": round(before.peak / mib, 1),
        "export_added_peak_mib": round((during.peak - before.peak) / mib, 1), "seconds": round(seconds, 2),
        "devices": len(jax.devices()),
    }))


if __name__ == "__main__":
    main()
