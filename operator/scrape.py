"""Scrape runtime pods' `/metrics` and turn per-pod samples into windowed readings.

- `scrape_pods` fetches every pod concurrently, each read bounded in size and total time
  (`pod_http.py`); a pod that fails (connect error, timeout, a body too large, non-200,
  unparsable text) yields a sample with `error` set, never
  an empty sample that would read as zero load.
- `parse_metrics` reads the vLLM-named families with prometheus_client's parser, keeping only
  the served model's label set when a model name is given.
- `SampleStore` keeps each pod's recent samples (a plain object for kopf's `memo`) and reduces
  them to `MetricReading`s: counters become rates over a window (counter resets, i.e. pod
  restarts, count the new value as the increase, as Prometheus does), gauges are averaged. A
  pod whose latest scrape failed, or with too few samples in a window, has no data in it. A
  counter's total over the pods is the pods' increase over the window's span (a pod that
  joined mid-window adds what it served), a gauge's the sum of the per-pod means.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kubeinfer.operator.autoscale_types import (
    METRIC_NAMES,
    MetricName,
    MetricReading,
    PodSample,
    PodTarget,
)
from kubeinfer.operator.pod_http import MAX_METRICS_BYTES, PodReadError, bounded_get

logger = logging.getLogger(__name__)

# Our metric -> the Prometheus samples it is made of. Counters are summed rates, gauges means.
COUNTER_SOURCES: dict[MetricName, tuple[str, ...]] = {
    "generationTokensPerSecond": ("vllm:generation_tokens_total",),
    "totalTokensPerSecond": ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
}
GAUGE_SOURCES: dict[MetricName, str] = {
    "requestsWaiting": "vllm:num_requests_waiting",
    "requestsRunning": "vllm:num_requests_running",
    "kvCacheUsage": "vllm:kv_cache_usage_perc",
}
_COUNTERS = {name for names in COUNTER_SOURCES.values() for name in names}
_GAUGES = set(GAUGE_SOURCES.values())


class MetricsParseError(ValueError):
    """A /metrics body that is not Prometheus text or lacks the runtime's metrics."""


def parse_metrics(
    text: str, model_name: str | None = None
) -> tuple[dict[str, float], dict[str, float]]:
    """(counters, gauges) by Prometheus sample name, summed over label sets of `model_name`."""
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise MetricsParseError(f"not Prometheus text: {exc}") from exc
    for family in families:
        for s in family.samples:
            if model_name is not None and s.labels.get("model_name", model_name) != model_name:
                continue
            if s.name in _COUNTERS or s.name in _GAUGES:
                if not math.isfinite(s.value):
                    raise MetricsParseError(f"{s.name} is {s.value}, not a finite number")
            if s.name in _COUNTERS:
                counters[s.name] = counters.get(s.name, 0.0) + s.value
            elif s.name in _GAUGES:
                gauges[s.name] = gauges.get(s.name, 0.0) + s.value
    if not counters and not gauges:
        raise MetricsParseError("no vllm:* metrics in the response")
    return counters, gauges


async def scrape_pod(
    client: httpx.AsyncClient,
    target: PodTarget,
    *,
    timeout_s: float,
    model_name: str | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> PodSample:
    """One pod's sample, stamped when its answer arrived; failures carry `error`."""
    try:
        status_code, body = await bounded_get(
            client, target.url, max_bytes=MAX_METRICS_BYTES, timeout_s=timeout_s
        )
        if status_code != 200:
            raise MetricsParseError(f"HTTP {status_code}")
        counters, gauges = parse_metrics(body.decode("utf-8", errors="replace"), model_name)
    except (PodReadError, MetricsParseError) as exc:
        logger.debug("scrape of %s failed: %s", target.name, exc)
        return PodSample(target.name, clock(), error=f"{type(exc).__name__}: {exc}")
    return PodSample(target.name, clock(), counters, gauges)


async def scrape_pods(
    client: httpx.AsyncClient,
    targets: Iterable[PodTarget],
    *,
    timeout_s: float = 2.0,
    model_name: str | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> list[PodSample]:
    """All pods' samples, fetched concurrently, in the order of `targets`."""
    return list(
        await asyncio.gather(
            *(
                scrape_pod(client, t, timeout_s=timeout_s, model_name=model_name, clock=clock)
                for t in targets
            )
        )
    )


@dataclass(slots=True, frozen=True)
class _Increase:
    """A counter's increase between the first and the last sample that hold it."""

    value: float
    start: float
    end: float


def _counter_increase(samples: list[PodSample], sources: tuple[str, ...]) -> _Increase | None:
    """The sources' summed increase over the samples (a drop means a restart: the new value
    counts); None when a source has fewer than two samples."""
    value, start, end = 0.0, float("inf"), float("-inf")
    for source in sources:
        points = [(s.time, s.counters[source]) for s in samples if source in s.counters]
        if len(points) < 2 or points[-1][0] <= points[0][0]:
            return None
        for (_, before), (_, after) in zip(points, points[1:], strict=False):
            value += after - before if after >= before else after
        start, end = min(start, points[0][0]), max(end, points[-1][0])
    return _Increase(value, start, end)


class SampleStore:
    """Recent samples per pod, reduced to windowed per-pod values and totals.

    `grace_s` widens each window backwards so that a window about one scrape interval long
    still holds two samples when scrapes jitter (the daemon passes half the interval).
    """

    def __init__(self, *, retention_s: float, grace_s: float = 1.0) -> None:
        self.retention_s = retention_s
        self.grace_s = grace_s
        self._samples: dict[str, deque[PodSample]] = {}

    @property
    def pod_names(self) -> list[str]:
        return list(self._samples)

    def add(self, samples: Iterable[PodSample]) -> None:
        for s in samples:
            self._samples.setdefault(s.pod, deque()).append(s)

    def retain(self, pod_names: Iterable[str], now: float) -> None:
        """Forget pods that are gone and samples older than the retention."""
        keep = set(pod_names)
        for pod in list(self._samples):
            if pod not in keep:
                del self._samples[pod]
                continue
            q = self._samples[pod]
            while q and q[0].time < now - self.retention_s:
                q.popleft()

    def _recent(self, pod: str, now: float, window_s: float) -> list[PodSample] | None:
        """The pod's good samples in the window; None when its latest scrape failed."""
        q = self._samples.get(pod)
        if not q or not q[-1].is_ok:
            return None  # the latest scrape failed: stale samples are not today's load
        start = now - window_s - self.grace_s
        return [s for s in q if s.is_ok and start <= s.time <= now]

    def pod_value(self, pod: str, metric: MetricName, now: float, window_s: float) -> float | None:
        """The pod's rate (counter) or mean (gauge) over the window; None: no data."""
        recent = self._recent(pod, now, window_s)
        if recent is None:
            return None
        if metric in COUNTER_SOURCES:
            inc = _counter_increase(recent, COUNTER_SOURCES[metric])
            return None if inc is None else inc.value / (inc.end - inc.start)
        source = GAUGE_SOURCES[metric]
        values = [s.gauges[source] for s in recent if source in s.gauges]
        return sum(values) / len(values) if values else None

    def total(
        self, pods: Iterable[str], metric: MetricName, now: float, window_s: float
    ) -> tuple[float, int]:
        """(total over `pods`, number of pods with data) in the window.

        A gauge's total is the sum of the per-pod means. A counter's total is the model's rate:
        the pods' summed increase over the time the window's samples span, as Prometheus'
        `sum(rate(x[w]))` has it. A pod that joined mid-window adds what it served, not its own
        rate over its few seconds as if it had served the whole window: 16 pods that drained a
        backlog in the 5 s since they became ready would otherwise read as 16 x their capacity.
        The span is the samples' (not the window's), so a restarted daemon reads full rates.
        """
        pods = list(pods)
        if metric not in COUNTER_SOURCES:
            values = [self.pod_value(p, metric, now, window_s) for p in pods]
            known = [v for v in values if v is not None]
            return sum(known), len(known)
        increases = []
        for pod in pods:
            recent = self._recent(pod, now, window_s)
            inc = None if recent is None else _counter_increase(recent, COUNTER_SOURCES[metric])
            if inc is not None:
                increases.append(inc)
        if not increases:
            return 0.0, 0
        span = max(i.end for i in increases) - min(i.start for i in increases)
        return sum(i.value for i in increases) / span, len(increases)

    def reading(
        self,
        metric: MetricName,
        target_per_replica: float,
        *,
        ready_pods: Iterable[str],
        now: float,
        stable_window_s: float,
        panic_window_s: float,
    ) -> MetricReading:
        """The metric over both windows, for `decide`."""
        pods = list(ready_pods)
        stable, num_stable = self.total(pods, metric, now, stable_window_s)
        panic, num_panic = self.total(pods, metric, now, panic_window_s)
        return MetricReading(metric, target_per_replica, stable, num_stable, panic, num_panic)

    def snapshot(
        self, ready_pods: Iterable[str], now: float, window_s: float
    ) -> dict[MetricName, float]:
        """Every metric over the window for status.metrics: totals; KV usage as a mean."""
        pods = list(ready_pods)
        out: dict[MetricName, float] = {}
        for metric in METRIC_NAMES:
            value, num = self.total(pods, metric, now, window_s)
            if num:
                out[metric] = value / num if metric == "kvCacheUsage" else value
        return out
