#!/usr/bin/env bash
# Download, on a machine with network, the wheels the device image lacks for tx into .whl/ at the repo root
# (git-ignored; the device run copies the working tree, .whl included, and run.sh installs them offline).
#
#   bash benchmarks/device/wheels.sh            # resolve, download, check the size, verify with Python 3.12
#   NO_VERIFY=1 bash benchmarks/device/wheels.sh
#
# How: pip resolves benchmarks/device/requirements.txt for the device (CPython 3.12, manylinux x86_64, wheels
# only) without installing anything (--dry-run --report); the closure is walked from those requirements, not
# descending into what the image already ships (IMAGE_HAS); each remaining name==version is downloaded with
# --no-deps. Then the folder must stay under 64 MiB (what a device run carries), and the wheels must install
# offline into an empty Python 3.12 target together with stand-ins for the image's packages (downloaded to a
# scratch folder only for this check) and import.
#
# Env: PYTHON (runs pip; default python3), PY312 (a Python 3.12 for the check; default: pyenv's newest 3.12,
# else python3.12), NO_VERIFY=1 skips the check.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
DEST="$ROOT/.whl"
PYTHON="${PYTHON:-python3}"
LIMIT=$((64 * 1024 * 1024))
# Distributions the image ships (its listed packages and their usual dependencies); never downloaded. Small
# ones that may or may not be there (typing-extensions, anyio, sniffio, h11, click, ...) are downloaded:
# run.sh skips a wheel the image already has at that version or newer.
IMAGE_HAS="jax jaxlib jax-cuda13-plugin jax-cuda13-pjrt flax optax orbax-checkpoint transformers peft torch
tokenizers safetensors huggingface-hub hf-xet jinja2 markupsafe httpx httpcore certifi idna pyyaml tqdm numpy
ml-dtypes protobuf rich markdown-it-py mdurl pygments regex filelock fsspec packaging requests urllib3
charset-normalizer"
PLATFORM_FLAGS=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
                --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
                --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any)

SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT

echo "resolving $HERE/requirements.txt for CPython 3.12 manylinux x86_64 ..."
"$PYTHON" -m pip install --quiet --dry-run --ignore-installed --target "$SCRATCH/resolve" "${PLATFORM_FLAGS[@]}" \
    --report "$SCRATCH/report.json" -r "$HERE/requirements.txt"

# name==version of the closure outside the image, and (for the check) name==version of the image's part
"$PYTHON" - "$SCRATCH/report.json" "$HERE/requirements.txt" "$IMAGE_HAS" "$SCRATCH" <<'EOF'
import json
import re
import sys

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
except ImportError:  # pip's own copy
    from pip._vendor.packaging.markers import Marker  # noqa: F401
    from pip._vendor.packaging.requirements import Requirement

report, req_file, image_has, scratch = sys.argv[1:]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
       "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython"}
items = {norm(i["metadata"]["name"]): i for i in json.load(open(report))["install"]}
image = {norm(n) for n in image_has.split()}


def wanted(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate(env | {"extra": e}) for e in extras | {""})


roots = [Requirement(line.split("#")[0].strip()) for line in open(req_file) if line.split("#")[0].strip()]
todo = [(norm(r.name), set(r.extras)) for r in roots]
seen: dict[str, set[str]] = {}
image_part: set[str] = set()
while todo:
    name, extras = todo.pop()
    if name in image:
        image_part.add(name)
        # an extra of an image package (httpx[http2]) may need what the image lacks: ship the extra's own deps
        for dep in items[name]["metadata"].get("requires_dist", []):
            req = Requirement(dep)
            if wanted(req, extras) and not wanted(req, set()):
                todo.append((norm(req.name), set(req.extras)))
        continue
    if name in seen and extras <= seen[name]:
        continue
    seen[name] = seen.get(name, set()) | extras
    for dep in items[name]["metadata"].get("requires_dist", []):
        req = Requirement(dep)
        if wanted(req, seen[name]):
            todo.append((norm(req.name), set(req.extras)))


def pins(names):
    return "".join(f"{items[n]['metadata']['name']}=={items[n]['metadata']['version']}\n" for n in sorted(names))


open(f"{scratch}/ship.txt", "w").write(pins(seen))
# the image's part, with its own closure, for the offline install check only
closure, todo = set(), list(image_part)
while todo:
    name = todo.pop()
    if name in closure or name not in items:
        continue
    closure.add(name)
    todo += [norm(Requirement(d).name) for d in items[name]["metadata"].get("requires_dist", [])
             if wanted(Requirement(d), set())]
open(f"{scratch}/image.txt", "w").write(pins(closure - set(seen)))
print(f"closure: {len(seen)} distributions to ship, {len(closure - set(seen))} provided by the image")
EOF

rm -rf "$SCRATCH/wheels" && mkdir -p "$SCRATCH/wheels"
echo "downloading (--no-deps):" $(tr '\n' ' ' < "$SCRATCH/ship.txt")
"$PYTHON" -m pip download --quiet --no-deps "${PLATFORM_FLAGS[@]}" -d "$SCRATCH/wheels" -r "$SCRATCH/ship.txt"
shipped=$(ls "$SCRATCH/wheels"/*.whl | wc -l)
if [ "$shipped" -ne "$(grep -c . "$SCRATCH/ship.txt")" ]; then
    echo "error: downloaded $shipped wheels for $(grep -c . "$SCRATCH/ship.txt") distributions" >&2
    exit 1
fi
bytes=$(cat "$SCRATCH/wheels"/*.whl | wc -c)
echo "total: $bytes bytes ($((bytes / 1024)) KiB) in $shipped wheels (limit $LIMIT bytes)"
if [ "$bytes" -ge "$LIMIT" ]; then
    echo "error: the wheels exceed 64 MiB, which a device run cannot carry" >&2
    exit 1
fi
rm -rf "$DEST" && mkdir -p "$DEST" && cp "$SCRATCH/wheels"/*.whl "$DEST/"
cp "$SCRATCH/ship.txt" "$DEST/SHIPPED.txt"
ls -l "$DEST"

if [ "${NO_VERIFY:-0}" = 1 ]; then
    exit 0
fi
PY312="${PY312:-$(ls -d "$HOME"/.pyenv/versions/3.12.*/bin/python 2>/dev/null | sort -V | tail -1)}"
PY312="${PY312:-$(command -v python3.12 || true)}"
if [ -z "$PY312" ] || ! "$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    echo "error: no Python 3.12 for the check (set PY312, or NO_VERIFY=1)" >&2
    exit 1
fi
echo "check: offline install of the wheels + stand-ins for the image's part into an empty 3.12 target ($PY312)"
mkdir -p "$SCRATCH/image"
"$PYTHON" -m pip download --quiet --no-deps "${PLATFORM_FLAGS[@]}" -d "$SCRATCH/image" -r "$SCRATCH/image.txt"
# with dependency resolution: every requirement of every wheel must be met by .whl or the image's part
# (PIP_CONFIG_FILE=/dev/null and no PIP_* variables: only these two folders, no site pip.conf, constraints or index)
offline_pip() { env $(env | sed -n 's/^\(PIP_[A-Z_]*\)=.*/-u \1/p') PIP_CONFIG_FILE=/dev/null "$PY312" -m pip "$@"; }
offline_pip install --quiet --no-index --find-links "$DEST" --find-links "$SCRATCH/image" \
    --target "$SCRATCH/site" -r "$HERE/requirements.txt"
PYTHONPATH="$SCRATCH/site" "$PY312" -c '
import cloudpathlib, fastapi, pydantic, pyrage, sqlalchemy, starlette, uvicorn, zstandard
from tinker.proto import tinker_public_pb2
print("imports ok: pydantic", pydantic.VERSION, "fastapi", fastapi.__version__, "sqlalchemy", sqlalchemy.__version__)'
# what run.sh does on the device: the shipped wheels alone, --no-deps, into a --target folder
offline_pip install --quiet --no-index --no-deps --target "$SCRATCH/nodeps" "$DEST"/*.whl
echo "ok: $shipped wheels, $bytes bytes, install offline on Python 3.12"
