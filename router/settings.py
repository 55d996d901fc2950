"""RouterSettings: every `kubeinfer router` option, from the CLI or `KUBEINFER_ROUTER_*` env vars.

Pods come from the Kubernetes API (`selector`, in `namespace`, on `pod_port`) or from a static
list (`backends`, plus `backends_file`: one URL per line, `#` comments, re-read every
`discovery_interval_s`, so a dev setup or a test adds and removes backends by rewriting it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kubeinfer.router.routing_types import PickerConfig


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KUBEINFER_ROUTER_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    backends: list[str] = []
    """Static backend base URLs (http://host:port), always routable."""
    backends_file: Path | None = None
    """A file of backend URLs, one a line, re-read every discovery interval (a missing file
    reads as no backends)."""
    selector: str | None = None
    """Label selector of the model's pods; their ready pod IPs on `pod_port` are the backends."""
    namespace: str = "default"
    pod_port: int = Field(8000, ge=1, le=65535)
    model_name: str | None = None
    """Only this `model_name` label set counts in a pod's /metrics (default: all)."""
    discovery_interval_s: float = Field(2.0, gt=0.0, le=60.0)
    """How often the backend list is refreshed (a list of pods, served from the API server's
    watch cache, or the backends file)."""
    scrape_interval_s: float = Field(1.0, gt=0.0, le=60.0)
    """How often each backend's /metrics is read (queue depth, KV usage)."""
    scrape_timeout_s: float = Field(1.0, gt=0.0, le=30.0)
    """A scrape gets this long in all (connect, headers, body of at most 2 MiB); a failure marks
    the pod stale (routed on the router's own in-flight count), not dead."""
    prefix_chars: int = Field(256, ge=1)
    """Leading prompt characters hashed into the prefix key (about 64 tokens, 4 KV blocks);
    shorter prompts are placed by load."""
    affinity_keys: int = Field(65536, ge=1, le=1 << 22)
    """Prefix and session keys whose pods the router remembers (least recently used forgotten
    first); a forgotten key is placed like a new one, by load."""
    balance_factor: float = Field(1.25, ge=1.0)
    """Bounded load: affinity keeps a pod while its load stays within this factor of the mean."""
    kv_weight: float = Field(4.0, ge=0.0)
    """A full KV cache scores as this many queued requests."""
    kv_saturation: float = Field(0.95, gt=0.0, le=1.0)
    """Affinity skips a pod whose KV usage is at least this."""
    stale_penalty: float = Field(2.0, ge=0.0)
    """A pod without a current scrape scores as this many more queued requests."""
    max_held_requests: int = Field(256, ge=0)
    """With no ready pod, at most this many requests wait (0: answer 503 at once)."""
    max_hold_s: float = Field(300.0, gt=0.0)
    """A held request waits at most this long for a pod, then gets 503."""
    retry_after_s: int = Field(5, ge=1)
    """The Retry-After of a 503 from the router."""
    max_request_bytes: int = Field(8 << 20, ge=1024)
    """Larger request bodies get 413 before any pod is picked."""
    max_connect_retries: int = Field(2, ge=0, le=16)
    """A request whose pod refuses the connection tries this many other pods."""
    connect_timeout_s: float = Field(3.0, gt=0.0)
    upstream_timeout_s: float = Field(600.0, gt=0.0)
    """Longest wait for the next bytes from a pod (the first token of a long prefill included)."""
    max_connections: int = Field(1024, ge=1)
    """Open connections to the pods, in all."""
    drain_timeout_s: float = Field(30.0, ge=0.0)
    """On SIGTERM, how long requests in flight may take to finish."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _has_a_source(self) -> RouterSettings:
        if not (self.backends or self.backends_file or self.selector):
            raise ValueError("give backends, a backends file or a pod selector")
        if self.selector and (self.backends or self.backends_file):
            raise ValueError("a pod selector and static backends do not mix")
        return self

    def picker_config(self) -> PickerConfig:
        return PickerConfig(
            balance_factor=self.balance_factor,
            kv_weight=self.kv_weight,
            kv_saturation=self.kv_saturation,
            stale_penalty=self.stale_penalty,
        )
