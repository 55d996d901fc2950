"""ServerSettings: every `kubeinfer serve` option, from the CLI or `KUBEINFER_*` env vars.

One field per option; the env var is the field name upper-cased with the prefix
(`KUBEINFER_MAX_NUM_SEQS`), so Helm values and the operator map onto it one to one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kubeinfer.runtime.engine.config import EngineConfig, default_batched_tokens


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KUBEINFER_", extra="forbid")

    model: Path
    """Model folder (HF layout: config.json, safetensors, tokenizer)."""
    served_model_name: str | None = None
    """Name in /v1/models and the `model` field; default: the folder's name."""
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    probe_port: int | None = Field(None, ge=1, le=65535)
    """Also serve /health, /ready and /metrics on this port, from a thread and event loop of
    their own, so probes and scrapes answer while the API port is flooded."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    max_model_len: int | None = Field(None, ge=2)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    """Token budget of one step; default: 8192 on a GPU, 2048 on CPU (vLLM's served defaults)."""
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_fraction: float = Field(0.9, gt=0.0, le=1.0)
    kv_cache_memory_bytes: int = Field(2 << 30, ge=1 << 20)
    enable_prefix_caching: bool = True
    kernels: Literal["auto", "torch", "triton"] = "auto"
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """Devices (ranks) one replica spans, one worker process each; see EngineConfig."""
    api_key: SecretStr | None = None
    """When set, /v1/* requests need `Authorization: Bearer <key>` (empty or blank: refused)."""
    max_request_bytes: int | None = Field(None, ge=1024)
    """Larger request bodies get 413; default: 8 bytes per character of `max_input_chars`
    (JSON escapes and UTF-8), at least 1 MiB."""
    max_input_chars: int | None = Field(None, ge=1)
    """Most characters in one prompt (or all of a chat's messages) before tokenizing; default:
    32 per token of max_model_len, so a body never costs more CPU than the context justifies."""
    max_prompts_per_request: int = Field(128, ge=1)
    """Most sequences in one request: prompts x n (each becomes an engine request)."""
    max_stop_strings: int = Field(16, ge=0)
    """Most `stop` strings per request (OpenAI allows 4)."""
    max_stop_string_chars: int = Field(256, ge=1)
    """Longest `stop` string, in characters."""
    max_stop_token_ids: int = Field(128, ge=0)
    """Most `stop_token_ids` per request."""
    max_logit_bias: int = Field(300, ge=0)
    """Most `logit_bias` entries per request."""
    max_chat_messages: int = Field(2048, ge=1)
    """Most messages in one chat request (OpenAI's limit)."""
    max_queued_requests: int | None = Field(None, ge=1)
    """Requests waiting (being tokenized or queued for the engine) before new ones get 429;
    default: 4 x max_num_seqs."""
    max_queued_tokens: int | None = Field(None, ge=1)
    """Prompt tokens waiting for the engine before new requests get 429 (a request is always
    admitted into an empty queue); default: 16 x max_num_batched_tokens."""
    tokenizer_workers: int = Field(2, ge=1, le=64)
    """Threads that tokenize and render chat templates, off the event loop."""
    engine_stall_timeout: float = Field(60.0, gt=0.0)
    """/health fails when the engine has work but finished no step for this long (a hung
    engine gets restarted by the liveness probe)."""
    shutdown_delay: float = Field(0.0, ge=0.0)
    """On SIGTERM, keep serving this long with /ready failing, so endpoints drop the pod
    before it refuses work (the operator sets it; 0 refuses at once)."""
    drain_timeout: float = Field(30.0, ge=0.0)
    """After the shutdown delay, seconds to finish in-flight requests before exiting."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    metrics_fault_file: Path | None = None
    """Test hook: while this file exists, GET /metrics answers 503, as a pod whose metrics port
    is blocked would (the autoscaler's cluster test makes scrapes fail under load with it)."""

    @field_validator("api_key")
    @classmethod
    def _key_not_blank(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and not key.get_secret_value().strip():
            raise ValueError("the API key is empty or blank: give a real key, or none")
        return key

    @model_validator(mode="after")
    def _ports_differ(self) -> ServerSettings:
        if self.probe_port == self.port:
            raise ValueError(f"probe_port must differ from port ({self.port})")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name

    def batched_tokens(self) -> int:
        return self.max_num_batched_tokens or default_batched_tokens(self.device, serving=True)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.batched_tokens(),
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_fraction=self.kv_cache_memory_fraction,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
            kernels=self.kernels,
            tensor_parallel_size=self.tensor_parallel_size,
        )
