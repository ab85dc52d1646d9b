"""External weights (a PEFT adapter directory, optionally age-encrypted per file) and checkpoint copies.

An external-weights checkpoint is a versioned directory (see storage.write_dir) holding
`adapter_config.json` and `adapter_model.safetensors`, or the same names with `.age` appended when the
caller gave age recipients: each file is then encrypted to all of them (filippo.io/age, via pyrage).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tx.checkpoints import storage

MAX_RECIPIENTS = 10
AGE_SUFFIX = ".age"


def _pyrage():
    try:
        import pyrage
    except ImportError:  # pragma: no cover - pyrage is a dependency; a trimmed install may lack it
        raise ValueError("age_encryption_recipients needs the `pyrage` package on the server") from None
    return pyrage


def parse_recipients(recipients: list[str] | None, field: str = "age_encryption_recipients") -> list:
    """age recipients (native `age1...` or SSH public keys), each checked; ValueError naming the bad one."""
    if not recipients:
        return []
    if len(recipients) > MAX_RECIPIENTS:
        raise ValueError(f"{field} has {len(recipients)} recipients; at most {MAX_RECIPIENTS} are allowed")
    pyrage = _pyrage()
    parsed = []
    for i, text in enumerate(recipients):
        kind = pyrage.ssh if isinstance(text, str) and text.startswith("ssh-") else pyrage.x25519
        try:
            parsed.append(kind.Recipient.from_str(text))
        except (pyrage.RecipientError, TypeError, ValueError) as e:
            shown = text if len(str(text)) <= 120 else f"{str(text)[:120]}..."
            raise ValueError(f"{field}[{i}] = {shown!r} is not an age or SSH public key: {e}") from None
    return parsed


def encrypt_dir(directory: Path, recipients: list[str]) -> None:
    """Replace every file under `directory` by `<name>.age`, encrypted to all `recipients`."""
    parsed = parse_recipients(recipients)
    pyrage = _pyrage()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        pyrage.encrypt_file(str(path), str(path) + AGE_SUFFIX, parsed)
        path.unlink()


def publish_dir(directory: Path, output_path, recipients: list[str] | None) -> None:
    """The files of local `directory` (encrypted in place to `recipients` when given) as a new version of
    the checkpoint directory `output_path`."""
    if recipients:
        encrypt_dir(directory, recipients)
    with storage.write_dir(output_path) as out:
        for path in sorted(directory.iterdir()):
            shutil.copyfile(path, out / path.name)


def current_version(location: str):
    """The directory holding the current version of a versioned checkpoint directory (local or cloud)."""
    target = storage.as_path(location)
    pointer = target / storage.POINTER
    if not pointer.exists():
        raise storage.CheckpointNotFound(f"no checkpoint at {location} (missing {storage.POINTER})")
    version = target / pointer.read_text().strip()
    if not version.exists():
        raise storage.CheckpointNotFound(f"checkpoint at {location} points to missing version {version.name}")
    return version


def list_files(location: str) -> dict[str, object]:
    """{path relative to the checkpoint root: its file} for the current version of `location`."""
    version = current_version(location)
    files = {}
    for path in version.rglob("*"):
        if path.is_file():
            files[str(path.relative_to(version)).replace(os.sep, "/")] = path
    return dict(sorted(files.items()))


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (no bytes duplicated, yet deleting either name leaves the other) or, across
    filesystems, a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def copy_checkpoint(source: str, dest: str, kind: str) -> None:
    """Copy a checkpoint's current files to `dest` (crash-safe like a save: readers see all or nothing)."""
    if kind == "sampler_weights":
        with storage.read_file(source) as local:
            if storage.is_remote(dest):
                storage.write_file_atomic(dest, local)
            else:
                tmp = Path(dest).with_name(f".{Path(dest).name}{storage.TMP_MARK}copy")
                tmp.unlink(missing_ok=True)
                _link_or_copy(local, tmp)
                os.replace(tmp, dest)
        return
    with storage.read_dir(source) as local, storage.write_dir(dest) as out:
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            _link_or_copy(path, out / path.relative_to(local))
