"""The engine's settings (each one a `python -m tx.run` flag)."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator


class EngineConfig(BaseModel):
    checkpoint_root: str = Field(description="directory or cloud URL under which checkpoints are written")
    batch_window_s: float = Field(0.02, ge=0, description="while other tenants are active, wait this long for "
                                  "their passes to join a round")
    session_timeout_s: float = Field(600.0, gt=0, description="a session without heartbeat this long expires "
                                     "and its models are unloaded")
    seq_gap_timeout_s: float = Field(120.0, gt=0, description="skip a missing seq_id after waiting this long")
    max_pass_datums: int = Field(4096, ge=1, description="datums per forward/forward_backward backend call; a "
                                 "request with more is refused (413)")
    max_pass_tokens: int = Field(1 << 20, ge=1, description="tokens per forward/forward_backward backend call "
                                 "(requests of several tenants share a call up to this)")
    max_request_tokens: int = Field(1 << 18, ge=1, description="tokens of one forward/forward_backward request; "
                                    "a request with more is refused (413)")
    max_samples: int = Field(1024, ge=1, description="sequences per sampling backend call")
    sampling_share: float = Field(0.5, gt=0, le=1, description="while training requests wait, sampling runs "
                                  "between training rounds for share/(1-share) times the last round's training "
                                  "time (at least one engine iteration); 1 = sampling runs until nothing samples")
    max_queued_samples: int = Field(16384, ge=1, description="queued sequences beyond which asample answers 429 "
                                    "(the SDK backs off and retries)")

    @model_validator(mode="after")
    def _request_fits_a_call(self) -> EngineConfig:
        # a request runs in one backend call, so that its gradients are accumulated all or nothing
        if self.max_request_tokens > self.max_pass_tokens:
            raise ValueError(f"max_request_tokens {self.max_request_tokens} exceeds max_pass_tokens "
                             f"{self.max_pass_tokens}: a request must fit one backend call")
        return self
