"""ServerSettings: every `kubeinfer serve` option, from the CLI or `KUBEINFER_*` env vars.

One field per option; the env var is the field name upper-cased with the prefix
(`KUBEINFER_MAX_NUM_SEQS`), so Helm values and the operator map onto it one to one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from kubeinfer.runtime.engine.config import EngineConfig


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KUBEINFER_", extra="forbid")

    model: Path
    """Model folder (HF layout: config.json, safetensors, tokenizer)."""
    served_model_name: str | None = None
    """Name in /v1/models and the `model` field; default: the folder's name."""
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    max_model_len: int | None = Field(None, ge=2)
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_fraction: float = Field(0.9, gt=0.0, le=1.0)
    kv_cache_memory_bytes: int = Field(2 << 30, ge=1 << 20)
    enable_prefix_caching: bool = True
    kernels: Literal["auto", "torch", "triton"] = "auto"
    api_key: SecretStr | None = None
    """When set, /v1/* requests need `Authorization: Bearer <key>`."""
    max_request_bytes: int = Field(4 << 20, ge=1024)
    """Larger request bodies get 413."""
    drain_timeout: float = Field(30.0, ge=0.0)
    """Seconds SIGTERM waits for in-flight requests before exiting."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    metrics_fault_file: Path | None = None
    """Test hook: while this file exists, GET /metrics answers 503, as a pod whose metrics port
    is blocked would (the autoscaler's cluster test makes scrapes fail under load with it)."""

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_fraction=self.kv_cache_memory_fraction,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
            kernels=self.kernels,
        )
