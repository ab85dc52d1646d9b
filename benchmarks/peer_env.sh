#!/usr/bin/env bash
# The Python 3.12 venv that runs benchmarks/bench_peer.py: tx and SkyRL's JAX backend (PyPI skyrl, module
# skyrl.backends.jax, Python >= 3.12) side by side on one jax.
#
#   bash benchmarks/peer_env.sh                                     # -> $REPO/.venv-peer
#   PEER_VENV=/work/main/.venv-py312 bash benchmarks/peer_env.sh    # add skyrl to an existing 3.12 venv
#
# How the venv is made:
#   - PEER_VENV exists: reused; skyrl (and tx, editable, if it does not import from this repo) is added.
#   - else, if PEER_BASE_VENV (default $REPO/.venv-py312) is a 3.12 venv with jax, flax, torch, peft and
#     transformers: a new venv layered on it (a .pth appends the base's site-packages after its own), so
#     skyrl lands in PEER_VENV only and the base stays untouched. Nothing but skyrl is downloaded.
#   - else: a new venv from PyPI: tx and its deps, torch, peft, rich. JAX_VERSION pins jax and jaxlib,
#     JAX_EXTRA picks jax's extra (e.g. cuda13), TORCH_INDEX_URL an index for torch (e.g. a CPU build).
# skyrl is installed with --no-deps: its own pins (peft==0.18.1, transformers<=5.16.1) would move packages
# tx uses, and its JAX backend imports nothing tx's environment lacks besides peft and rich. The script
# fails if installing skyrl changed jax, so both engines run the same jax.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${PEER_VENV:-$REPO/.venv-peer}
BASE=${PEER_BASE_VENV:-$REPO/.venv-py312}
SKYRL_VERSION=${SKYRL_VERSION:-0.4.0}

find_python312() {
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
  local root
  if root=$(pyenv root 2>/dev/null); then
    local found
    found=$(ls -d "$root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -n 1 || true)
    if [[ -n "$found" ]]; then echo "$found"; return; fi
  fi
  command -v python3.12 || { echo "no Python 3.12 found (set PYTHON)" >&2; exit 1; }
}

minor() { "$1" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")'; }

base_usable() {
  [[ -x "$BASE/bin/python" ]] && [[ "$(minor "$BASE/bin/python")" == "3.12" ]] &&
    "$BASE/bin/python" -c 'import jax, flax, optax, torch, peft, rich, transformers' 2>/dev/null
}

if [[ -x "$VENV/bin/python" ]]; then
  echo "== reusing $VENV"
elif base_usable; then
  echo "== new venv $VENV layered on $BASE"
  py=$(readlink -f "$BASE/bin/python")
  "$py" -m venv "$VENV"
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  base_site=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  # addsitedir (not a bare path line) so the base's own .pth files (tx's editable finder) run too
  echo "import site; site.addsitedir('$base_site')" > "$site/_peer_base.pth"
else
  py=$(find_python312)
  echo "== new venv $VENV from $py (PyPI)"
  "$py" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  jax_req="jax${JAX_EXTRA:+[$JAX_EXTRA]}${JAX_VERSION:+==$JAX_VERSION}"
  "$VENV/bin/pip" install -q "$jax_req" ${JAX_VERSION:+"jaxlib==$JAX_VERSION"} -e "$REPO"
  "$VENV/bin/pip" install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch
  "$VENV/bin/pip" install -q peft rich
fi
# keep git status clean when the venv sits inside the repo (python < 3.13 does not write this itself)
[[ -e "$VENV/.gitignore" ]] || echo "*" > "$VENV/.gitignore"

PY="$VENV/bin/python"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 12))' || { echo "$VENV is not Python >= 3.12" >&2; exit 1; }

tx_root=$("$PY" -c 'import pathlib, tx; print(pathlib.Path(tx.__file__).resolve().parent.parent)' 2>/dev/null || true)
if [[ "$tx_root" != "$REPO" ]]; then
  "$PY" -m pip install -q --no-deps -e "$REPO"
fi

jax_before=$("$PY" -c 'import jax; print(jax.__version__)')
"$PY" -m pip install -q --no-deps "skyrl==$SKYRL_VERSION"
jax_after=$("$PY" -c 'import jax; print(jax.__version__)')
if [[ "$jax_before" != "$jax_after" ]]; then
  echo "installing skyrl moved jax $jax_before -> $jax_after" >&2
  exit 1
fi

# the import chain bench_peer.py uses, on CPU so this works on any machine
JAX_PLATFORMS=cpu "$PY" - <<'EOF'
import importlib.metadata as md
import logging
import sys

logging.disable(logging.WARNING)  # absl's tensorflow notice
import jax
import skyrl.backends.jax  # noqa: F401  the peer backend and everything it imports
import tx  # noqa: F401

print(f"python {sys.version.split()[0]} ({sys.executable})")
for name in ["jax", "jaxlib", "flax", "optax", "transformers", "torch", "peft", "skyrl", "tx"]:
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} (not installed)")
print(f"jax devices: {jax.devices()}")
EOF
echo "== run: $PY benchmarks/bench_peer.py --quick"
