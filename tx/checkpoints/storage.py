"""Where checkpoints live: local paths and cloud URLs (`gs://`, `s3://`, ... via cloudpathlib), written
crash-safely, and tarballs unpacked safely.

Directories (training checkpoints) are versioned: files go to `<path>/v-<id>/` and `<path>/LATEST`, a
one-line pointer, is written last. A crash before that leaves the previous version current; old
versions are removed after the pointer moves. Single files (sampler tarballs) are written under a
temporary name and renamed (local), or uploaded in one object write (cloud), so readers see either the
old or the new file. A failed write removes what it left (temporary file, unfinished version); what a
killed process left is removed by `sweep` (run at server start). Remote paths are staged in a local temp directory and copied with cloudpathlib,
the same code for every cloud scheme.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from cloudpathlib import CloudPath

POINTER = "LATEST"
TMP_MARK = ".tmp-"  # in the names of files being written (`.<name>.tmp-<id>`)


class CheckpointNotFound(FileNotFoundError):
    pass


def jax_process_count() -> int:
    import jax

    return jax.process_count()


def as_path(path: str | os.PathLike) -> Path | CloudPath:
    text = str(path)
    if "://" not in text:  # local: cloudpathlib (whose S3 client imports boto3) is imported on first remote use
        return Path(text)
    from cloudpathlib import AnyPath

    return AnyPath(text)


def _is_cloud_path(obj) -> bool:
    cloudpathlib = sys.modules.get("cloudpathlib")  # never imported: no CloudPath exists in this process
    return cloudpathlib is not None and isinstance(obj, cloudpathlib.CloudPath)


def is_remote(path) -> bool:
    return _is_cloud_path(as_path(path))


@contextlib.contextmanager
def write_dir(path: str | os.PathLike, version: str | None = None, primary: bool = True) -> Iterator[Path]:
    """Yield a local directory to fill; on success it becomes the current version of `path`.

    Multi-host: every process passes the same `version` and writes its part into the same (shared)
    directory; only the `primary` process moves the pointer and removes old versions."""
    target = as_path(path)
    version = f"v-{version or uuid.uuid4().hex[:12]}"
    if is_remote(target):
        if not primary or jax_process_count() > 1:
            raise ValueError(f"multi-host training checkpoints need a shared filesystem path, not {path}")
        with tempfile.TemporaryDirectory() as tmp:
            yield Path(tmp)
            try:
                (target / version).upload_from(tmp)
            except BaseException:
                _remove_quietly(target / version)
                raise
    else:
        local = Path(target) / version
        local.mkdir(parents=True, exist_ok=True)
        try:
            yield local
        except BaseException:
            if primary:
                shutil.rmtree(local, ignore_errors=True)
            raise
    if not primary:
        return
    try:
        _write_text_atomic(target / POINTER, version)
    except BaseException:
        _remove_quietly(target / version)  # never current: the previous version stays
        raise
    for old in target.iterdir():
        if old.name.startswith("v-") and old.name != version:
            remove(old)


@contextlib.contextmanager
def read_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a local directory holding the current version of `path`."""
    target = as_path(path)
    pointer = target / POINTER
    if not pointer.exists():
        raise CheckpointNotFound(f"no checkpoint at {path} (missing {POINTER})")
    version = target / pointer.read_text().strip()
    if not version.exists():
        raise CheckpointNotFound(f"checkpoint at {path} points to missing version {version.name}")
    if is_remote(target):
        with tempfile.TemporaryDirectory() as tmp:
            version.download_to(tmp)
            yield Path(tmp)
    else:
        yield Path(version)


def write_file_atomic(path: str | os.PathLike, data_path: Path) -> None:
    """Put the local file `data_path` at `path` so that readers never see a partial file."""
    target = as_path(path)
    if is_remote(target):
        target.upload_from(data_path, force_overwrite_to_cloud=True)
        return
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        shutil.copyfile(data_path, tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def read_file(path: str | os.PathLike) -> Iterator[Path]:
    target = as_path(path)
    if not target.exists():
        raise CheckpointNotFound(f"no checkpoint file at {path}")
    if is_remote(target):
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / target.name
            target.download_to(local)
            yield local
    else:
        yield Path(target)


def _write_text_atomic(path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", delete=False, suffix=".txt") as f:
        f.write(text)
    try:
        write_file_atomic(path, Path(f.name))
    finally:
        os.unlink(f.name)


def remove(path) -> None:
    """Delete a checkpoint directory or file, local or remote."""
    if _is_cloud_path(path):
        path.rmtree() if path.is_dir() else path.unlink()
    elif Path(path).is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        Path(path).unlink(missing_ok=True)


def _remove_quietly(path) -> None:
    try:
        remove(path)
    except Exception:  # noqa: BLE001 - cleanup after a failure must not hide that failure
        pass


def sweep(root: str | os.PathLike, older_than_s: float = 3600.0) -> list[Path]:
    """Remove what failed or killed saves left under a local checkpoint root: temporary files, and `v-*`
    versions that `LATEST` does not point to. Only entries older than `older_than_s` go, so a save in
    progress keeps its files. Cloud roots are not walked (listing a bucket can be slow and costly).
    Returns the removed paths."""
    if is_remote(root) or not Path(root).is_dir():
        return []
    cutoff = time.time() - older_than_s
    removed: list[Path] = []

    def old(path: Path) -> bool:
        try:
            return path.lstat().st_mtime < cutoff
        except OSError:
            return False

    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in filenames:
            if TMP_MARK in name and name.startswith(".") and old(here / name):
                (here / name).unlink(missing_ok=True)
                removed.append(here / name)
        versions = [d for d in dirnames if d.startswith("v-")]
        if versions:
            try:
                current = (here / POINTER).read_text().strip()
            except OSError:
                current = None
            for d in versions:
                if d != current and old(here / d):
                    shutil.rmtree(here / d, ignore_errors=True)
                    removed.append(here / d)
            dirnames[:] = [d for d in dirnames if d not in versions]  # do not walk into versions
    return removed


def pack_tar(source_dir: Path, out_file: Path, compress: bool = True) -> None:
    """Tar the entries of `source_dir`; gzip unless `compress=False` (model weights barely compress, and
    gzip would be the slowest step of saving a full model)."""
    with tarfile.open(out_file, "w:gz" if compress else "w") as tar:
        for item in sorted(source_dir.iterdir()):
            tar.add(item, arcname=item.name)


def unpack_tar(tar_file: Path, dest: Path) -> None:
    """Extract regular files and directories only; refuse absolute paths, `..`, links and devices."""
    with tarfile.open(tar_file, "r:*") as tar:
        members = tar.getmembers()
        for m in members:
            name = m.name
            if name.startswith("/") or os.path.isabs(name) or ".." in Path(name).parts:
                raise ValueError(f"refusing tar member with unsafe path {name!r}")
            if not (m.isfile() or m.isdir()):
                raise ValueError(f"refusing tar member {name!r}: links and special files are not allowed")
        tar.extractall(dest, members=members, filter="data")
