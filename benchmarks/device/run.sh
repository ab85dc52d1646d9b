#!/usr/bin/env bash
# tx's device suite: one unattended run on one GPU (or, with --dry-run, the same steps at tiny shapes on CPU).
#
#   bash benchmarks/device/run.sh [RESULTS_DIR] [--dry-run]
#
# RESULTS_DIR defaults to $OUT, else ./out/device. Writes there: results.jsonl (one JSON line per workload,
# appended as each finishes), logs/<step>.log, env.txt (nvidia-smi, versions, devices), summary.json.
# Env: PYTHON (default python3), SUITE_BUDGET_S (wall seconds for the whole suite; default 520, dry run 600),
# SUITE_STEP_LIMIT_S (caps every step's own limit), TX_DEVICE_WORK (scratch: checkpoints, installed wheels,
# JAX compile cache; default /tmp/tx-device[-dry]).
# Steps (README.md): setup (random checkpoints, on CPU, beside step a), a cuDNN attention, b LoRA training,
# c full fine-tuning, d decode, g PyTorch + PEFT (needs b and d's lines for its ratios), e RL sampling.
# Each step is its own process under `timeout`; one that fails or hangs gets an error line and the suite goes on.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"

DRY=0
RESULTS=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        -*) echo "unknown option $arg" >&2; exit 2 ;;
        *) RESULTS="$arg" ;;
    esac
done
RESULTS="${RESULTS:-${OUT:-$ROOT/out/device}}"
PY="${PYTHON:-python3}"
if [ "$DRY" = 1 ]; then
    BUDGET="${SUITE_BUDGET_S:-600}"
    WORK="${TX_DEVICE_WORK:-/tmp/tx-device-dry}"
    export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=""
    # the dry run checks code paths, not speed: XLA's CPU backend compiles ~30% faster unoptimised
    export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=0"
    DRY_FLAG=(--dry-run)
    # per-step limits (seconds): generous, for a loaded 2-core CPU
    declare -A LIMIT=([setup]=180 [a]=180 [b]=180 [c]=180 [d]=180 [e]=180 [g]=180)
else
    BUDGET="${SUITE_BUDGET_S:-520}"
    WORK="${TX_DEVICE_WORK:-/tmp/tx-device}"
    DRY_FLAG=()
    declare -A LIMIT=([setup]=240 [a]=60 [b]=120 [c]=100 [d]=200 [e]=110 [g]=130)
fi
START=$SECONDS
mkdir -p "$RESULTS/logs" "$WORK"
RESULTS="$(cd "$RESULTS" && pwd)"
JSONL="$RESULTS/results.jsonl"
: > "$JSONL"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1  # no network: never wait on the Hub
# compiled programs are kept (a rerun on the same machine compiles nothing; timings never include compiles)
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$WORK/jax-cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"

say() { echo "[device suite $((SECONDS - START))s] $*"; }

# ---- the wheels the image lacks (benchmarks/device/wheels.sh put them in .whl/) ----
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
    SITE="$WORK/site"
    rm -rf "$SITE"
    say "installing .whl/ into $SITE (offline, --no-deps)"
    "$PY" "$HERE/install_wheels.py" "$ROOT/.whl" "$SITE" || say "WARNING: wheel install failed (see above)"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    say "no .whl/ folder: using the interpreter's own packages"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # tx itself, from the working tree

# ---- where we are (and whether tx imports) ----
{
    echo "== suite: dry_run=$DRY budget=${BUDGET}s python=$("$PY" -c 'import sys; print(sys.version.split()[0])')"
    echo "== git: $(git rev-parse HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | wc -l) changed paths"
    echo "== nvidia-smi"
    if command -v nvidia-smi > /dev/null; then timeout 30 nvidia-smi || true; else echo "(no nvidia-smi)"; fi
    echo "== jax, packages, tx"
    timeout 120 "$PY" -c '
from importlib.metadata import version
import jax
print("jax", jax.__version__, "backend", jax.default_backend())
for d in jax.devices():
    print(" ", d, "|", d.device_kind)
for name in ("jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "peft", "torch", "pydantic", "tinker"):
    try:
        print(" ", name, version(name))
    except Exception as exc:
        print(" ", name, "MISSING", exc)
import tx, tx.backends.full, tx.sampling.continuous
print("import tx: ok")
' 2>&1 || echo "(FAILED: the steps will report why)"
} > "$RESULTS/env.txt" 2>&1
cat "$RESULTS/env.txt"

# ---- steps ----
LINES_SHOWN=0
show_new_lines() {
    local total
    total=$(wc -l < "$JSONL")
    if [ "$total" -gt "$LINES_SHOWN" ]; then
        tail -n +"$((LINES_SHOWN + 1))" "$JSONL" | head -n "$((total - LINES_SHOWN))"
        LINES_SHOWN=$total
    fi
}

fail_lines() {  # step message
    "$PY" "$HERE/suite.py" fail --results "$JSONL" --step "$1" --message "$2" --log "$RESULTS/logs/$1.log" \
        ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} || echo "{\"step\": \"$1\", \"error\": \"$2 (and suite.py fail failed)\"}" >> "$JSONL"
}

finish_step() {  # step rc limit
    local step=$1 rc=$2 limit=$3
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        fail_lines "$step" "timeout: step $step ran past its ${limit}s limit"
    elif [ "$rc" -ne 0 ]; then
        fail_lines "$step" "step $step exited with status $rc"
    fi
    show_new_lines
    say "step $step done (exit $rc)"
}

step_limit() {  # step -> seconds it may run now (0: no time left)
    local left=$((BUDGET - (SECONDS - START)))
    local limit=${LIMIT[$1]}
    if [ -n "${SUITE_STEP_LIMIT_S:-}" ] && [ "$SUITE_STEP_LIMIT_S" -lt "$limit" ]; then limit=$SUITE_STEP_LIMIT_S; fi
    if [ "$left" -lt 15 ]; then echo 0; elif [ "$left" -lt "$limit" ]; then echo "$left"; else echo "$limit"; fi
}

run_step() {  # step script
    local step=$1 script=$2 limit rc
    limit=$(step_limit "$step")
    if [ "$limit" -eq 0 ]; then
        fail_lines "$step" "skipped: the suite's ${BUDGET}s budget is spent"
        show_new_lines
        return
    fi
    say "step $step: $script (limit ${limit}s)"
    timeout -k 10 "$limit" "$PY" "$HERE/$script" --results "$JSONL" --models "$WORK/models" ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} \
        > "$RESULTS/logs/$step.log" 2>&1
    rc=$?
    finish_step "$step" "$rc" "$limit"
}

# setup writes the checkpoints on the CPU while step a uses the GPU
say "setup: random checkpoints into $WORK/models (background, CPU)"
SETUP_LIMIT=$(step_limit setup)
JAX_PLATFORMS=cpu timeout -k 10 "$SETUP_LIMIT" "$PY" "$HERE/setup_models.py" --results "$JSONL" \
    --models "$WORK/models" ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} > "$RESULTS/logs/setup.log" 2>&1 &
SETUP_PID=$!

run_step a step_attention.py

wait "$SETUP_PID"
finish_step setup $? "$SETUP_LIMIT"

run_step b step_lora.py
run_step c step_full.py
run_step d step_decode.py
run_step g step_torch.py
run_step e step_rl.py

WALL=$((SECONDS - START))
"$PY" - "$JSONL" "$RESULTS/summary.json" "$WALL" "$DRY" <<'EOF'
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
errors = [f"{r.get('step')}/{r.get('workload')}: {r['error'][:200]}" for r in rows if r.get("error")]
summary = {"lines": len(rows), "errors": len(errors), "error_lines": errors, "suite_wall_s": int(sys.argv[3]),
           "dry_run": sys.argv[4] == "1"}
json.dump(summary, open(sys.argv[2], "w"), indent=1)
print(json.dumps(summary))
EOF
say "done in ${WALL}s; results: $JSONL"
