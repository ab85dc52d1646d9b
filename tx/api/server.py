"""Run the Tinker-compatible service on process 0: store + engine + HTTP app under uvicorn."""

from __future__ import annotations

import ipaddress
import json
import logging
from pathlib import Path

from pydantic import BaseModel, Field

from tx.api import wire
from tx.api.app import ApiConfig, ServedModel, create_app
from tx.api.timeouts import timed_protocol
from tx.engine.engine import Engine, EngineConfig
from tx.engine.store import Store, database_url
from tx.models.loading import resolve_model_dir

logger = logging.getLogger(__name__)


class ServiceConfig(BaseModel):
    host: str = Field("127.0.0.1", description="address the HTTP API listens on")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    data_dir: Path = Field(Path("tx-data"), description="SQLite database and (by default) checkpoints")
    database_url: str | None = Field(None, description="SQLAlchemy URL, e.g. postgresql+psycopg://u:p@host/db")
    checkpoint_root: str | None = Field(None, description="checkpoint directory or gs:// / s3:// URL "
                                        "(default: <data-dir>/checkpoints)")
    model_name: str | None = Field(None, description="public name of the base model (default: --base-model)")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def served_model(base_model: str, model_dir: Path, name: str | None, backend) -> ServedModel:
    cfg = json.loads((model_dir / "config.json").read_text())
    public = name or base_model
    return ServedModel(
        model_name=public, aliases=sorted({public, base_model, str(model_dir)}),
        # clients load the tokenizer themselves: a local model's directory, else its hub id
        tokenizer_id=str(model_dir) if Path(base_model).is_dir() or base_model == "tiny" else base_model,
        arch=(cfg.get("architectures") or ["Qwen3ForCausalLM"])[0],
        max_context_length=backend.impl.max_seq_len, max_lora_rank=backend.impl.config.max_lora_rank,
        training_mode=backend.impl.training_mode,
        max_num_samples=backend.impl.config.max_num_samples, vocab_size=backend.impl.model.config.vocab_size,
        max_topk_logprobs=backend.impl.config.max_topk_prompt_logprobs,
        max_target_prompt_logprobs=backend.impl.config.max_target_prompt_logprobs)


def serve(backend, base_model: str, model_dir: str, service: ServiceConfig, engine_config: dict,
          api: ApiConfig, fatal: tuple[type[BaseException], ...] = (), extra: dict | None = None) -> None:
    """`extra`: more base models served beside `base_model`, name -> backend (requests choose by name)."""
    import uvicorn

    if not api.api_keys and not api.admin_api_keys and not api.no_auth:
        if not is_loopback(service.host):
            raise SystemExit(f"refusing to serve on {service.host} without API keys: pass --api-key (or "
                             "TX_API_KEYS) or --no-auth")
        logger.warning("no --api-key given: accepting any key on loopback %s", service.host)
        api = api.model_copy(update={"no_auth": True})
    store = Store(database_url(service.data_dir, service.database_url))
    root = service.checkpoint_root or str((service.data_dir / "checkpoints").resolve())
    served = served_model(base_model, resolve_model_dir(model_dir), service.model_name, backend)
    others = [served_model(name, b.impl.model_dir, None, b) for name, b in (extra or {}).items()]
    engine = Engine(backend, store, EngineConfig(checkpoint_root=root, **engine_config), served.model_name,
                    wire.encode_pass, wire.encode_sample, fatal=fatal,
                    extra_backends={s.model_name: b for s, b in zip(others, (extra or {}).values())})
    app = create_app(engine, store, api, served, others)
    server = uvicorn.Server(uvicorn.Config(app, host=service.host, port=service.port, log_level="warning",
                                           timeout_keep_alive=75, http=timed_protocol(api.read_timeout_s)))
    engine.on_fatal = lambda: setattr(server, "should_exit", True)
    engine.start()
    logger.info(json.dumps({"event": "serving", "url": f"http://{service.host}:{service.port}",
                            "model": served.model_name, "extra_models": [s.model_name for s in others], "database": store.url.split("@")[-1],
                            "checkpoints": root, "auth": not api.no_auth}))
    try:
        server.run()
    finally:
        engine.stop()
        store.close()
    if engine.error is not None:
        raise engine.error
