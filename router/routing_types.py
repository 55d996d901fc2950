"""The data that crosses the picker's boundary: request features and pod views in, a decision out.

Plain frozen dataclasses, so the pure `picker.pick`, the proxy and the tests share one
vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: Why a pod was chosen (the `reason` label of kubeinfer_router_decisions_total).
Reason = Literal["prefix", "session", "load", "only-pod"]
REASONS: tuple[Reason, ...] = ("prefix", "session", "load", "only-pod")


@dataclass(slots=True, frozen=True)
class RequestFeatures:
    """What routing reads from one request.

    `prefix_key`: a digest of the prompt's leading characters (None: too short to share a
    cache block worth routing for, or no prompt). `session_id`: the `x-session-id` header.
    `request_id`: unique per request; it breaks ties between equally loaded pods so that
    sequential requests without affinity spread instead of all landing on the first pod.
    """

    prefix_key: bytes | None = None
    session_id: str | None = None
    request_id: str = ""


@dataclass(slots=True, frozen=True)
class PodView:
    """One routable pod as the picker sees it.

    `num_in_flight` is the router's own count (exact, immediate). The scraped gauges are None
    while the pod is stale: its last scrape failed or none has answered yet; a stale pod is
    still routable, on its in-flight count alone.
    """

    name: str
    num_in_flight: int = 0
    num_waiting: float | None = None
    num_running: float | None = None
    kv_usage: float | None = None
    num_keys: int = 0
    """Affinity keys the router remembers sending to this pod (`affinity.AffinityIndex`)."""

    @property
    def is_stale(self) -> bool:
        return self.num_waiting is None or self.num_running is None

    @property
    def load(self) -> float:
        """Requests this pod holds: the router's in-flight count, or the pod's own running +
        waiting when that is higher (other router replicas send to it too)."""
        scraped = (self.num_waiting or 0.0) + (self.num_running or 0.0)
        return max(float(self.num_in_flight), scraped)


@dataclass(slots=True, frozen=True)
class PickerConfig:
    """The score's constants (RouterSettings carries them, documented there)."""

    balance_factor: float = 1.25
    kv_weight: float = 4.0
    kv_saturation: float = 0.95
    stale_penalty: float = 2.0


@dataclass(slots=True, frozen=True)
class Pick:
    pod: str
    reason: Reason


@dataclass(slots=True, frozen=True)
class Hold:
    """No pod is ready: wait in the hold queue (there is room)."""


@dataclass(slots=True, frozen=True)
class Reject:
    """Answer 503 with Retry-After; `why` says which bound."""

    why: str


Decision = Pick | Hold | Reject
