"""Install the wheels of .whl/ into a --target folder, offline, without shadowing the image's own packages.

    python3 benchmarks/device/install_wheels.py WHEEL_DIR TARGET

A wheel whose distribution this interpreter already has at the same or a newer version is skipped (so a
folder put first on PYTHONPATH never replaces, say, the image's typing-extensions with an older one); the
rest go in with `pip install --no-index --no-deps --target` (no pip.conf, no PIP_* variables, no index),
or, where this Python has no pip, are unpacked (a wheel is a zip of its site-packages files). Prints one
line per wheel and exits non-zero if an install failed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def parse_version(text: str) -> tuple:
    try:
        from packaging.version import Version

        return (Version(text),)
    except Exception:  # noqa: BLE001 - no packaging, or a version it cannot parse: compare numbers
        return tuple(int(x) for x in re.findall(r"\d+", text))


def installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def unpack(wheel: Path, target: Path) -> None:
    """A wheel's files into `target`: the package folders as they are, `<name>.data/{purelib,platlib}` merged."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue  # scripts, headers, data: not needed to import
                parts = parts[2:]
            dest = target.joinpath(*parts)
            if info.is_dir():
                dest.mkdir(parents=True, exist_ok=True)
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(z.read(info))
            mode = info.external_attr >> 16
            if mode:
                dest.chmod(mode & 0o777)


def main() -> None:
    wheel_dir, target = Path(sys.argv[1]), Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    todo = []
    for wheel in sorted(wheel_dir.glob("*.whl")):
        name, ver = wheel.name.split("-")[:2]
        have = installed(name)
        if have is not None and parse_version(have) >= parse_version(ver):
            print(f"  skip {name} {ver}: the image has {have}")
        else:
            print(f"  install {name} {ver}" + (f" (the image has {have})" if have else ""))
            todo.append(wheel)
    if not todo:
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, env=env).returncode == 0
    if has_pip:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "--target", str(target), *map(str, todo)]
        done = subprocess.run(cmd, env=env)
        if done.returncode != 0:
            raise SystemExit(f"pip install of {len(todo)} wheels into {target} failed (exit {done.returncode})")
    else:
        print("  (no pip for this Python: unpacking the wheels)")
        for wheel in todo:
            unpack(wheel, target)
    print(f"installed {len(todo)} wheels into {target}")


if __name__ == "__main__":
    main()
