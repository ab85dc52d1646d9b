"""Weights that leave their run: signed download URLs of external weights, publish / unpublish, copy_weights.

Access: a checkpoint is its owner's; a published one is also readable (load, sample, weights_info,
download, copy) with any tenant's key. Only the owner publishes, unpublishes, deletes or changes it.

Downloads: `get_external_weights_urls` answers one URL per file. Under a local checkpoint root the URLs
point at this server (`/api/v1/weights_files/...`), signed with an HMAC over the checkpoint, the file,
the expiry and whether the URL was granted through publication; the file route needs no API key, checks
the signature and expiry (403), and that the checkpoint still exists and, for a URL granted through
publication, is still published (404): unpublishing revokes such URLs at once. Under a gs:// or s3://
root the URLs are the object store's own presigned URLs (they cannot be revoked before they expire).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
import uuid
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, RedirectResponse

from tx.api import schemas
from tx.api.common import ApiError, Tenant, checkpoint_key, found, io, iso, owned, readable, tenant
from tx.api.context import ApiContext
from tx.checkpoints import external, storage
from tx.engine import paths, store_weights
from tx.engine.ops import SaveRequest, UserError

FILES_PREFIX = "/api/v1/weights_files/"
EXTERNAL = "external_weights"


def external_save_request(body: schemas.SaveWeightsExternal) -> SaveRequest:
    """save_weights_external's engine payload, every field checked (a bad one names itself)."""
    recipients = body.age_encryption_recipients or []
    try:
        external.parse_recipients(recipients)
    except ValueError as e:
        raise UserError(str(e)) from None
    return SaveRequest(paths.check_name(body.path), schemas.check_ttl(body.ttl_seconds), {},
                       age_recipients=[str(r) for r in recipients])


class UrlSigner:
    """HMAC-SHA256 signatures of download URLs: bound to the checkpoint, the file, the expiry and whether
    the URL was granted through publication."""

    def __init__(self, key: str | None):
        secret = key or os.environ.get("TX_URL_SIGNING_KEY")
        self.key = secret.encode() if secret else secrets.token_bytes(32)

    def _mac(self, model_id: str, name: str, file: str, expires: int, public: bool) -> str:
        message = "\n".join((model_id, name, file, str(expires), "1" if public else "0"))
        return hmac.new(self.key, message.encode(), hashlib.sha256).hexdigest()

    def path(self, model_id: str, name: str, file: str, expires: int, public: bool) -> str:
        query = urlencode({"expires": expires, "public": int(public),
                           "signature": self._mac(model_id, name, file, expires, public)})
        return f"{FILES_PREFIX}{quote(model_id, safe='')}/{quote(name, safe='')}/{quote(file)}?{query}"

    def check(self, model_id: str, name: str, file: str, expires: str, public: str, signature: str) -> bool:
        """Whether the URL is genuine and unexpired (403 otherwise); returns its `public` grant."""
        if public not in ("0", "1") or not expires.isdigit() or len(expires) > 12:
            raise ApiError(403, f"download URL is malformed (expires={expires[:20]!r}, public={public[:5]!r})")
        want = self._mac(model_id, name, file, int(expires), public == "1")
        if not hmac.compare_digest(want, signature):
            raise ApiError(403, "download URL signature does not match (altered, or signed by another server key)")
        if int(expires) < time.time():
            raise ApiError(403, f"download URL expired at {iso(int(expires))}; ask for new URLs")
        return public == "1"


def router(ctx: ApiContext) -> APIRouter:
    engine, store, config = ctx.engine, ctx.store, ctx.config
    signer = UrlSigner(config.url_signing_key)
    routes = APIRouter()

    # ---- downloads ----

    def signed_urls(run_id: str, name: str, who: Tenant, base_url: str) -> dict:
        key = checkpoint_key(run_id, EXTERNAL, name)
        row = readable(store.checkpoint(*key), who, f"checkpoint {paths.tinker_path(*key)}")
        via_public = not who.sees(row["owner"])
        try:
            files = external.list_files(row["location"])
        except storage.CheckpointNotFound as e:
            raise ApiError(404, str(e)) from None
        ttl = config.signed_url_ttl_s
        expires = int(time.time()) + ttl
        if storage.is_remote(row["location"]):
            urls = {rel: f.as_url(presign=True, expire_seconds=ttl) for rel, f in files.items()}
        else:
            base = (config.public_url or base_url).rstrip("/")
            urls = {rel: base + signer.path(run_id, name, rel, expires, via_public) for rel in files}
        return {"urls": urls, "expires": iso(expires)}

    @routes.get(f"/api/v1/training_runs/{{run_id}}/checkpoints/{EXTERNAL}/{{name}}/external_weights_urls")
    async def external_weights_urls(run_id: str, name: str, request: Request):
        return await io(signed_urls, run_id, name, tenant(request), str(request.base_url))

    def signed_file(model_id: str, name: str, file: str, expires: str, public: str, signature: str):
        via_public = signer.check(model_id, name, file, expires, public, signature)
        row = store.checkpoint(model_id, EXTERNAL, name)
        what = f"checkpoint {paths.tinker_path(model_id, EXTERNAL, name)}"
        if row is None or (via_public and not row["public"]):
            raise ApiError(404, f"{what} not found (deleted, or no longer published)")
        try:
            path = external.list_files(row["location"]).get(file)
        except storage.CheckpointNotFound:
            path = None
        found(path, f"file {file!r} of {what}")
        if storage.is_remote(row["location"]):
            return RedirectResponse(path.as_url(presign=True, expire_seconds=300))
        return FileResponse(path, media_type="application/octet-stream", filename=path.name)

    @routes.get(FILES_PREFIX + "{model_id}/{name}/{file:path}")
    async def weights_file(model_id: str, name: str, file: str, expires: str = "", public: str = "0",
                           signature: str = ""):
        return await io(signed_file, model_id, name, file, expires, public, signature)

    # ---- publish / unpublish ----

    def set_public(run_id: str, kind: str, name: str, who: Tenant, public: bool) -> dict:
        key = checkpoint_key(run_id, kind, name)
        what = f"checkpoint {paths.tinker_path(*key)}"
        owned(store.checkpoint(*key), who, what)  # the owner only: published is readable, not theirs
        changed = found(store_weights.set_public(store, *key, public), what)
        if not changed:
            raise ApiError(409, f"{what} is already {'public' if public else 'private'}")
        return {}

    @routes.post("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def publish(run_id: str, kind: str, name: str, request: Request):
        return await io(set_public, run_id, kind, name, tenant(request), True)

    @routes.delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    async def unpublish(run_id: str, kind: str, name: str, request: Request):
        return await io(set_public, run_id, kind, name, tenant(request), False)

    # ---- copy_weights ----

    def copy(body: schemas.CopyWeights, who: Tenant, idempotency_key: str | None, access_token: str | None) -> str:
        if body.weights_access_token is not None or access_token is not None:
            raise ApiError(400, "weights_access_token is not supported by this server: the owner can publish the "
                                "checkpoint, which makes it readable with every key")
        ttl = schemas.check_ttl(body.ttl_seconds)
        source = paths.parse_tinker_path(body.source_path, "source_path")
        _, kind, name = source
        row = readable(store.checkpoint(*source), who, f"source_path: checkpoint {body.source_path}")
        if body.session_id is not None:
            if body.model_seq_id is None:
                raise ApiError(400, "copy_weights with session_id needs model_seq_id")
            owned(store.session(body.session_id), who, f"session_id {body.session_id!r}")
            session_id, seq, new_session = body.session_id, body.model_seq_id, False
        elif body.destination_project_id is not None:
            # one new session per copy; a retry (same X-Idempotency-Key, same tenant) finds the same one
            seed = f"{who.id}\n{idempotency_key or uuid.uuid4().hex}"
            session_id, seq, new_session = f"copy-{hashlib.sha256(seed.encode()).hexdigest()[:24]}", 0, True
        else:
            raise ApiError(400, "copy_weights needs destination_project_id, or session_id and model_seq_id")
        model_id = paths.model_id_of(session_id, seq)
        copied = paths.tinker_path(model_id, kind, name)

        def earlier_copy() -> str:
            existing = store.model(model_id)
            if (existing is not None and who.sees(existing["owner"]) and existing["status"] == "copied"
                    and existing["user_metadata"].get("copied_from") == body.source_path):
                return copied  # a retry of this very copy
            raise ApiError(409, f"model_seq_id {seq} of session {session_id} is already used" if not new_session
                           else f"X-Idempotency-Key {idempotency_key!r} was used for a different copy")

        if store.model(model_id) is not None:
            return earlier_copy()
        source_model = store.model(source[0]) or {}
        dest = paths.location(engine.config.checkpoint_root, model_id, kind, name)
        external.copy_checkpoint(row["location"], dest, kind)
        meta = {"copied_from": body.source_path}
        if body.destination_project_id is not None:
            meta["project_id"] = body.destination_project_id  # tx has no projects: kept as a label
        if not store_weights.add_copy(
                store, session_id=session_id, new_session=new_session, model_id=model_id,
                base_model=source_model.get("base_model", engine.base_model),
                lora_config=source_model.get("lora_config", {}), user_metadata=meta, owner=who.id, kind=kind,
                name=name, location=dest, expires_at=None if ttl is None else time.time() + ttl,
                size_bytes=row["size_bytes"]):
            return earlier_copy()  # a concurrent retry recorded it first (same files)
        return copied

    @routes.post("/api/v1/copy_weights")
    async def copy_weights(request: Request):
        body = await ctx.parse(request, schemas.CopyWeights)
        path = await io(copy, body, tenant(request), request.headers.get("x-idempotency-key"),
                        request.headers.get("x-tinker-weights-access-token"))  # where the SDK sends it
        return {"tinker_path": path}

    return routes
