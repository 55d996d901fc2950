"""The operator's own Prometheus metrics (`kubeinfer_operator_*`) on a registry of its own.

Reconciles by result, errors by kind, reconcile durations, drift repairs by child kind,
status writes, the number of models watched, the keys waiting in the work queue, and whether
this replica leads. `serve` starts
the /metrics endpoint.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reconciles = Counter(
            "kubeinfer_operator_reconciles",
            "Reconciles of an InferenceModel, by result: applied (something was written), "
            "unchanged (nothing to write), failed (cannot be served as asked), retry.",
            ["result"],
            registry=r,
        )
        self.errors = Counter(
            "kubeinfer_operator_errors",
            "Failed API calls and unservable specs, by kind.",
            ["kind"],
            registry=r,
        )
        self.duration = Histogram(
            "kubeinfer_operator_reconcile_duration_seconds",
            "Time of one reconcile: snapshot, plan and writes.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.drift_repairs = Counter(
            "kubeinfer_operator_drift_repairs",
            "Children re-applied because they were deleted or edited, by child id "
            "(manifests.CHILDREN).",
            ["kind"],
            registry=r,
        )
        self.status_writes = Counter(
            "kubeinfer_operator_status_writes", "InferenceModel status updates.", registry=r
        )
        self.models = Gauge(
            "kubeinfer_operator_models", "InferenceModels the operator watches.", registry=r
        )
        self.queue_depth = Gauge(
            "kubeinfer_operator_queue_depth",
            "InferenceModel keys waiting in the work queue.",
            registry=r,
        )
        self.is_leader = Gauge(
            "kubeinfer_operator_leader",
            "1 while this replica acts (it holds the Lease, or runs without leader election).",
            registry=r,
        )

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics on host:port from a daemon thread (port 0: not at all)."""
        if port:
            start_http_server(port, addr=host, registry=self.registry)
