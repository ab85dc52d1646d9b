"""Store writes for weights that leave their run: publishing a checkpoint and recording a copy.

Kept apart from store.py (same tables, same transactions) so the core store stays small.
"""

from __future__ import annotations

import time

import sqlalchemy as sa

from tx.engine.schema import checkpoints, models, sessions
from tx.engine.store import Store


def _key(model_id: str, kind: str, name: str) -> tuple:
    return checkpoints.c.model_id == model_id, checkpoints.c.kind == kind, checkpoints.c.name == name


def set_public(store: Store, model_id: str, kind: str, name: str, public: bool) -> bool | None:
    """Publish or unpublish a checkpoint: None if it does not exist, False if it already was so."""
    with store.engine.begin() as conn:
        now = conn.execute(sa.select(checkpoints.c.public).where(*_key(model_id, kind, name))).first()
        if now is None:
            return None
        if bool(now[0]) == public:
            return False
        conn.execute(checkpoints.update().where(*_key(model_id, kind, name)).values(public=public))
    return True


def add_copy(store: Store, *, session_id: str, new_session: bool, model_id: str, base_model: str, lora_config: dict,
             user_metadata: dict, owner: str, kind: str, name: str, location: str, expires_at: float | None,
             size_bytes: int | None) -> bool:
    """Record a copied checkpoint and the run that holds it (status `copied`: it cannot be trained), in a new
    finished session when `new_session`. False (nothing written) if that session or model already exists."""
    now = time.time()
    with store.engine.begin() as conn:
        if conn.execute(sa.select(models.c.model_id).where(models.c.model_id == model_id)).first() is not None:
            return False
        if new_session:
            if conn.execute(sa.select(sessions.c.session_id).where(sessions.c.session_id == session_id)).first():
                return False
            conn.execute(sessions.insert().values(
                session_id=session_id, created_at=now, last_heartbeat=now, status="finished", tags=["copy_weights"],
                user_metadata={}, sdk_version=None, display_name=None, owner=owner))
        conn.execute(models.insert().values(
            model_id=model_id, session_id=session_id, base_model=base_model, lora_config=lora_config,
            user_metadata=user_metadata, status="copied", created_at=now, last_request_time=now, owner=owner))
        conn.execute(checkpoints.insert().values(
            model_id=model_id, kind=kind, name=name, location=location, created_at=now, expires_at=expires_at,
            size_bytes=size_bytes, user_metadata={}, owner=owner))
    return True
