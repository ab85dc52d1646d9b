"""Settings of the HTTP API and what the served model tells clients."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ApiConfig(BaseModel):
    api_keys: list[str] = Field(default_factory=list, description="accepted X-API-Key values, one tenant each")
    admin_api_keys: list[str] = Field(default_factory=list, description="X-API-Key values that see every tenant's work")
    no_auth: bool = Field(False, description="accept any key (local use): each distinct key value is a tenant")
    max_body_bytes: int = Field(64 << 20, ge=1024, description="largest request body (as sent)")
    max_decompressed_bytes: int = Field(256 << 20, ge=1024, description="largest zstd-decompressed body")
    long_poll_s: float = Field(30.0, gt=0, le=40, description="how long retrieve_future holds a pending request")
    compress_fwdbwd: bool = Field(True, description="ask the SDK to zstd-compress forward_backward bodies")
    read_timeout_s: float = Field(30.0, gt=0, description="a request's headers must arrive within this many seconds "
                                  "and its body without a longer pause (slow clients are disconnected)")
    public_url: str | None = Field(None, description="base URL clients reach this server at, for signed download "
                                   "URLs (default: the URL of the request that asked for them)")
    url_signing_key: str | None = Field(None, description="secret for signing download URLs, so they survive a "
                                        "restart (default: $TX_URL_SIGNING_KEY, else a random key per start)")
    signed_url_ttl_s: int = Field(3600, ge=60, le=7 * 24 * 3600, description="how long a signed download URL works")


# Tinker's LoRA alpha: adapters scale by 32 / rank, so the cookbook's learning rates (hyperparam_utils,
# lora_alpha=32) transfer unchanged and do not depend on the rank.
TINKER_LORA_ALPHA = 32.0


class ServedModel(BaseModel):
    """What this server serves: the base model's public name and where clients find its tokenizer."""

    model_name: str
    aliases: list[str]
    tokenizer_id: str
    arch: str
    max_context_length: int
    max_lora_rank: int
    training_mode: str = "lora"  # "full": one model at a time trains every weight; the LoRA rank is ignored
    max_num_samples: int
    # sampling limits checked at submit (400 naming the field); 0 = unknown here, the backend checks them
    vocab_size: int = 0
    max_topk_logprobs: int = 0
    max_target_prompt_logprobs: int = 0
