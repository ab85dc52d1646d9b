"""Tinker ids and checkpoint paths: `{session_id}:train:{n}` model ids and
`tinker://{model_id}/{weights|sampler_weights}/{name}` checkpoints, and where their files live."""

from __future__ import annotations

import re

from tx.checkpoints import storage
from tx.engine.ops import UserError

KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")
_MODEL_ID = re.compile(r"[A-Za-z0-9_\-]{1,64}:train:[0-9]{1,9}")


def model_id_of(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def sampling_session_id_of(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


def check_name(name: str, field: str = "path") -> str:
    """Checkpoint names become file names: letters, digits, '.', '_', '-' only (no '/', no '..')."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise UserError(f"{field} {name!r} is not a valid checkpoint name: use 1-128 of [A-Za-z0-9._-], "
                        "starting with a letter or digit, without '..'")
    return name


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def parse_tinker_path(path: str, field: str = "path") -> tuple[str, str, str]:
    """(model_id, kind, name) of a tinker:// checkpoint path, every part checked."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise UserError(f"{field} {path!r} is not a tinker:// checkpoint path")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3:
        raise UserError(f"{field} {path!r} must be tinker://<model_id>/<weights|sampler_weights>/<name>")
    model_id, kind, name = parts
    if not _MODEL_ID.fullmatch(model_id):
        raise UserError(f"{field} {path!r}: {model_id!r} is not a model id of this server")
    if kind not in KINDS:
        raise UserError(f"{field} {path!r}: kind {kind!r} must be one of {sorted(KINDS)}")
    return model_id, kind, check_name(name, field)


def location(root: str, model_id: str, kind: str, name: str) -> str:
    """Where a checkpoint's files go under the checkpoint root (a local directory or a cloud URL)."""
    suffix = ".tar.gz" if kind == "sampler_weights" else ""
    return str(storage.as_path(root) / model_id / kind / f"{name}{suffix}")


def session_of(model_id: str) -> str | None:
    """The session a `{session_id}:train:{n}` model id was created in (None for another form)."""
    session, sep, _ = model_id.rpartition(":train:")
    return session if sep else None
