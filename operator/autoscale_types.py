"""The data that crosses the autoscaler's boundaries: scrape -> windows -> decide -> daemon.

Everything here is a plain dataclass (slots) with no behaviour beyond trivial helpers, so the
pure decision (`autoscaler.decide`), the sample store (`scrape.SampleStore`), the daemon and the
trace-replay simulator (`bench/autoscale_sim.py`) share one vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

MetricName = Literal[
    "generationTokensPerSecond",
    "totalTokensPerSecond",
    "requestsWaiting",
    "requestsRunning",
    "kvCacheUsage",
]
METRIC_NAMES: tuple[MetricName, ...] = (
    "generationTokensPerSecond",
    "totalTokensPerSecond",
    "requestsWaiting",
    "requestsRunning",
    "kvCacheUsage",
)
# Metrics that measure a backlog (work already arrived and not yet served), not the demand
# (a rate of arrivals, or the work in flight that it keeps up). `decide` lets a backlog scale
# up but does not hold replicas for it through the scale-down delay once it is drained.
BACKLOG_METRICS: frozenset[MetricName] = frozenset({"requestsWaiting"})
# How a metric reads in a reason or an event ("generation tokens/s 5,400 over target ...").
METRIC_LABELS: dict[MetricName, str] = {
    "generationTokensPerSecond": "generation tokens/s",
    "totalTokensPerSecond": "total tokens/s",
    "requestsWaiting": "requests waiting",
    "requestsRunning": "requests running",
    "kvCacheUsage": "KV cache usage",
}


@dataclass(slots=True, frozen=True)
class Policy:
    """spec.autoscaling of an InferenceModel, plus the fixed constants of the algorithm."""

    min_replicas: int = 1
    max_replicas: int = 4
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    scale_down_delay_s: float = 300.0
    # |load / (replicas * target) - 1| within this: hold.
    tolerance: float = 0.1
    # The panic window asking for this many times the ready replicas starts panic mode.
    panic_threshold: float = 2.0
    # One step grows to at most this many times the current replicas (and at least +1) ...
    max_scale_up_rate: float = 2.0
    # ... and shrinks to no less than replicas / this.
    max_scale_down_rate: float = 2.0
    # With min_replicas 0: this long without a request at the router scales to zero.
    scale_to_zero_after_s: float = 300.0


@dataclass(slots=True, frozen=True)
class MetricReading:
    """One metric over both windows, summed over the ready pods that had data.

    `*_total` is the total over the `num_*_pods` ready pods with enough samples in that window:
    for counters their summed increase over the span of the window's samples (a rate), for
    gauges the sum of their means; ready pods without data (failed or too few scrapes) are
    simply not in it.
    """

    metric: MetricName
    target_per_replica: float
    stable_total: float
    num_stable_pods: int
    panic_total: float
    num_panic_pods: int


@dataclass(slots=True, frozen=True)
class RouterDemand:
    """The model's router pods' view of demand at one tick, summed over them.

    `num_held` requests wait for a first ready replica, `num_in_flight` are at the pods,
    `num_requests` is the routers' finished-requests counter (it moving between ticks means
    requests came and went in between). `is_complete` is False when a router pod's scrape
    failed (or none was ready): the sums then miss demand, which is never read as none.
    """

    num_held: int
    num_in_flight: int
    num_requests: float
    is_complete: bool


@dataclass(slots=True, frozen=True)
class Observation:
    """What the daemon knows at one tick.

    `current_replicas` is spec.replicas: every pod asked for, ready or still starting, is
    capacity already on its way. `num_ready` counts the ready (serving) pods. `router` is the
    routers' demand (None: the model has no router, or none could be read).
    """

    now: float
    current_replicas: int
    num_ready: int
    readings: tuple[MetricReading, ...]
    router: RouterDemand | None = None


@dataclass(slots=True, frozen=True)
class ScalerState:
    """What `decide` carries from one tick to the next (kept in kopf's memo).

    `recommendations` are (time, replicas) over the last scale_down_delay_s; `panic_until`
    is when panic mode ends unless the panic condition holds again.
    """

    recommendations: tuple[tuple[float, int], ...] = ()
    panic_until: float | None = None
    #: when a request was last seen at the router (None: not yet looked), and the routers'
    #: request counter then, for the scale to zero
    last_request_at: float | None = None
    num_router_requests: float | None = None


@dataclass(slots=True, frozen=True)
class Decision:
    """The replicas to ask for and why.

    `replicas` is what to write to spec.replicas (== current when holding). `recommended` is
    what the metrics asked for before rate limits and the [min, max] clamp. `is_limited` says
    the clamp cut the recommendation (ScalingLimited), with `limited_reason`.
    """

    replicas: int
    reason: str
    recommended: int
    is_limited: bool
    limited_reason: str
    is_panicking: bool
    metric: MetricName | None
    state: ScalerState


@dataclass(slots=True, frozen=True)
class PodTarget:
    """A pod to scrape: its name and its metrics URL."""

    name: str
    url: str


@dataclass(slots=True)
class PodSample:
    """One scrape of one pod: counters and gauges by our metric names (failed: `error`)."""

    pod: str
    time: float
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.error is None
