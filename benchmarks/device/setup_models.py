"""Write the suite's random Qwen3 checkpoints (bf16, tied embeddings, std 0.02) into --models, one process per
model at once, on the CPU (run.sh runs this beside step a, so it must not take the GPU: JAX_PLATFORMS=cpu).

A checkpoint already there with the same spec (a `spec.json` written last) is kept: a rerun on the same
machine does not write it again. One JSON line, workload `setup_models`.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from suite import MODELS, Results, step_args


def spec_for(shape: dict):
    from common import model_spec  # benchmarks/common.py: the benchmarks' TinySpec of a shape

    args = SimpleNamespace(**shape)
    return model_spec(args, dtype="bfloat16", tie_word_embeddings=True)


def write(target: str, shape: dict) -> tuple[str, float, bool]:
    """(folder, seconds, reused)."""
    from tx.models.tiny import write_tiny_model

    start = time.perf_counter()
    spec = spec_for(shape)
    out = Path(target)
    marker = out / "spec.json"
    if marker.exists() and json.loads(marker.read_text()) == spec.model_dump():
        return target, time.perf_counter() - start, True
    marker.unlink(missing_ok=True)
    write_tiny_model(out, spec)
    marker.write_text(json.dumps(spec.model_dump()))
    return target, time.perf_counter() - start, False


def main() -> None:
    args = step_args("setup", __doc__.split("\n\n")[0])
    results = Results(args.results, "setup", args.dry_run, None)
    shapes = MODELS["dry" if args.dry_run else "full"]
    with results.workload("setup_models") as row:
        row["framework"] = None
        row["shapes"] = {name: shape | {"dtype": "bfloat16", "tie_word_embeddings": True} for name, shape in shapes.items()}
        with ProcessPoolExecutor(len(shapes)) as pool:
            jobs = {name: pool.submit(write, str(Path(args.models) / name), shape) for name, shape in shapes.items()}
            done = {name: job.result() for name, job in jobs.items()}
        row["write_s"] = {name: round(s, 2) for name, (_, s, _) in done.items()}
        row["reused"] = {name: reused for name, (_, _, reused) in done.items()}
        row["bytes_on_disk"] = {name: sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
                                for name, (path, _, _) in done.items()}


if __name__ == "__main__":
    # here, not at import: profile_decode.py imports `write` and must keep the GPU (the writers are children)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
