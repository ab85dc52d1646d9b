"""Score texts with a model: per-token log-probs and perplexity as JSON lines.

    python -m tx.score                      # the built-in tiny model, sample texts
    python -m tx.score Qwen/Qwen3-0.6B --text "The capital of France is Paris." --tp 1

Loads an HF Qwen3 / Qwen3-MoE checkpoint (local directory or hub id) onto a (fsdp, ep, tp) mesh, runs
one jit-compiled forward over a right-padded batch and prints one JSON object per text plus a summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

from tx.models.config import LoraSlots
from tx.models.loading import load_model, resolve_model_dir
from tx.models.sharding import batch_spec, describe_mesh, make_mesh, resolve_mesh_shape
from tx.models.tiny import TinySpec, write_tiny_model

SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Fine-tuning adapts a pretrained model to a task.",
    "Hello, world!",
]


def tiny_model_dir() -> Path:
    """The built-in tiny model, written once to a temp directory."""
    path = Path(tempfile.gettempdir()) / "tx-tiny-qwen3"
    if not (path / "config.json").exists():
        write_tiny_model(path, TinySpec())
    return path


@partial(jax.jit, static_argnames="chunk_size")
def _token_logprobs(model, ids_bt, mask_bt, targets_bt, chunk_size: int):
    hidden_btd = model(ids_bt, mask_bt)
    return model.target_logprobs(hidden_btd, targets_bt, chunk_size=chunk_size)


def score(model_dir: Path, texts: list[str], mesh, dtype: str | None, chunk_size: int) -> list[dict]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_model(model_dir, LoraSlots(max_lora_adapters=1, max_lora_rank=1), mesh, dtype=dtype)
    encoded = [tokenizer(t)["input_ids"] for t in texts]
    fsdp = mesh.shape["fsdp"]
    rows = -(-len(encoded) // fsdp) * fsdp  # the batch is sharded over fsdp
    length = max(2, max(len(e) for e in encoded))
    ids = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), np.int32)
    for i, e in enumerate(encoded):
        ids[i, : len(e)], mask[i, : len(e)] = e, 1
    targets = np.roll(ids, -1, axis=1)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, batch_spec(x.ndim)))  # noqa: E731
    start = time.perf_counter()
    logprobs = np.asarray(_token_logprobs(model, put(ids), put(mask), put(targets), chunk_size))
    elapsed = time.perf_counter() - start
    results = []
    for i, (text, e) in enumerate(zip(texts, encoded)):
        lp = logprobs[i, : len(e) - 1]  # the last token has no next-token target
        results.append(
            {
                "text": text,
                "tokens": len(e),
                "sum_logprob": float(lp.sum()),
                "perplexity": float(np.exp(-lp.mean())) if len(lp) else None,
                "token_logprobs": [round(float(x), 5) for x in lp],
            }
        )
    results.append({"summary": True, "texts": len(texts), "seconds_incl_compile": round(elapsed, 3),
                    "device": jax.devices()[0].device_kind, "mesh": dict(mesh.shape)})
    return results


def _mesh_size(value: str) -> int:
    return -1 if value.strip().lower() == "auto" else int(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tx.score", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="tiny",
                        help="HF model directory or hub id; 'tiny' (default) writes and uses the built-in tiny model")
    parser.add_argument("--text", action="append", help="text to score (repeatable; default: three sample texts)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="base weight dtype (default: the checkpoint's)")
    parser.add_argument("--fsdp", type=_mesh_size, default=-1, help="mesh size of the fsdp axis (default -1 or "
                        "'auto': the devices ep x tp leave, so the mesh spans every device)")
    parser.add_argument("--ep", type=_mesh_size, default=1, help="mesh size of the expert-parallel axis")
    parser.add_argument("--tp", type=_mesh_size, default=1, help="mesh size of the tensor-parallel axis")
    parser.add_argument("--chunk-size", type=int, default=1024, help="tokens per log-prob chunk")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        shape = resolve_mesh_shape(args.fsdp, args.ep, args.tp, jax.device_count(), jax.process_count(),
                                   names={"fsdp": "--fsdp", "ep": "--ep", "tp": "--tp"})
    except ValueError as e:
        parser.error(str(e))
    mesh = make_mesh(shape.fsdp, shape.ep, shape.tp, devices=jax.devices()[:shape.size])
    logging.getLogger(__name__).info("mesh %s", describe_mesh(mesh, jax.device_count(), jax.process_count()))
    model_dir = tiny_model_dir() if args.model == "tiny" else resolve_model_dir(args.model)
    for row in score(model_dir, args.text or SAMPLE_TEXTS, mesh, args.dtype, args.chunk_size):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
