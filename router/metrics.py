"""The router's own /metrics (Prometheus text): requests, decisions, held demand, per-pod load.

- `kubeinfer_router_requests_total{pod,code}`: finished exchanges by pod and status code; `pod`
  is "none" when the router answered itself (503 with no pod, 413, 404); a stream broken by its
  pod counts as 502, a client that left as 499.
- `kubeinfer_router_decisions_total{reason}`: picks by reason (prefix, session, load, only-pod).
- `kubeinfer_router_held_requests`: requests waiting for a first ready pod (the autoscaler's
  signal to scale from zero); `kubeinfer_router_hold_seconds`: how long each waited.
- `kubeinfer_router_pod_in_flight{pod}`, `kubeinfer_router_pod_stale{pod}` (1: last scrape
  failed) and `kubeinfer_router_pods`: the router's view of its pods, read at scrape time.
- `kubeinfer_router_upstream_retries_total`: connections refused by a pod and tried elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kubeinfer.router.routing_types import REASONS, PodView, Reason

_HOLD_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
NO_POD = "none"


class _ViewCollector(Collector):
    def __init__(self, views: Callable[[], list[PodView]], num_held: Callable[[], int]) -> None:
        self.views, self.num_held = views, num_held

    def collect(self) -> Iterator[Metric]:
        views = self.views()
        held = GaugeMetricFamily(
            "kubeinfer_router_held_requests", "Requests waiting for a first ready pod."
        )
        held.add_metric([], self.num_held())
        yield held
        pods = GaugeMetricFamily("kubeinfer_router_pods", "Routable pods.")
        pods.add_metric([], len(views))
        yield pods
        in_flight = GaugeMetricFamily(
            "kubeinfer_router_pod_in_flight", "Requests in flight to the pod.", labels=["pod"]
        )
        stale = GaugeMetricFamily(
            "kubeinfer_router_pod_stale", "1 while the pod's last scrape failed.", labels=["pod"]
        )
        for v in views:
            in_flight.add_metric([v.name], v.num_in_flight)
            stale.add_metric([v.name], 1.0 if v.is_stale else 0.0)
        yield in_flight
        yield stale


class RouterMetrics:
    def __init__(self, views: Callable[[], list[PodView]], num_held: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kubeinfer_router_requests",
            "Finished requests by pod and status code.",
            ["pod", "code"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "kubeinfer_router_decisions",
            "Routing decisions by reason.",
            ["reason"],
            registry=self.registry,
        )
        for reason in REASONS:  # exported at 0 from the start, so rates work
            self.decisions.labels(reason)
        self.hold_seconds = Histogram(
            "kubeinfer_router_hold_seconds",
            "Time requests waited for a first ready pod.",
            buckets=_HOLD_BUCKETS,
            registry=self.registry,
        )
        self.retries = Counter(
            "kubeinfer_router_upstream_retries",
            "Connections refused by a pod and tried on another.",
            registry=self.registry,
        )
        self.registry.register(_ViewCollector(views, num_held))

    def observe_request(self, pod: str, code: int) -> None:
        self.requests.labels(pod, str(code)).inc()

    def observe_decision(self, reason: Reason) -> None:
        self.decisions.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
