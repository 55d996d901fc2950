"""The model's demand as its router pods see it: `scrape_routers(...) -> RouterDemand`.

Each ready router pod's `/metrics` (router/metrics.py) is read concurrently, bounded in size
and time like the runtime pods' (`pod_http.bounded_get`), and parsed with prometheus_client:
`kubeinfer_router_held_requests` (requests waiting for a first ready replica),
`kubeinfer_router_pod_in_flight` (summed over pods) and `kubeinfer_router_requests_total`
(summed over pods and codes). The sums over the router pods go to the autoscaler; one pod
that cannot be read (or none ready) makes the demand incomplete, which `decide` never takes
for idleness.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kubeinfer.operator.autoscale_types import PodTarget, RouterDemand
from kubeinfer.operator.pod_http import MAX_METRICS_BYTES, PodReadError, bounded_get

logger = logging.getLogger(__name__)

HELD = "kubeinfer_router_held_requests"
IN_FLIGHT = "kubeinfer_router_pod_in_flight"
REQUESTS = "kubeinfer_router_requests_total"


class RouterMetricsError(ValueError):
    """A router's /metrics that is not Prometheus text or lacks the held-requests gauge."""


def parse_router_metrics(text: str) -> tuple[int, int, float]:
    """(held, in flight, requests so far) from one router pod's /metrics."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise RouterMetricsError(f"not Prometheus text: {exc}") from exc
    held: float | None = None
    in_flight = requests = 0.0
    for family in families:
        for s in family.samples:
            if s.name == HELD:
                held = s.value
            elif s.name == IN_FLIGHT:
                in_flight += s.value
            elif s.name == REQUESTS:
                requests += s.value
    if held is None:
        raise RouterMetricsError(f"no {HELD} in the response")
    if not all(math.isfinite(v) for v in (held, in_flight, requests)):
        raise RouterMetricsError("a router metric is not a finite number")
    return max(0, int(held)), max(0, int(in_flight)), requests


async def _scrape_one(
    client: httpx.AsyncClient, target: PodTarget, timeout_s: float
) -> tuple[int, int, float] | None:
    try:
        status_code, body = await bounded_get(
            client, target.url, max_bytes=MAX_METRICS_BYTES, timeout_s=timeout_s
        )
        if status_code != 200:
            raise RouterMetricsError(f"HTTP {status_code}")
        return parse_router_metrics(body.decode("utf-8", errors="replace"))
    except (PodReadError, RouterMetricsError) as exc:
        logger.debug("router scrape of %s failed: %s", target.name, exc)
        return None


async def scrape_routers(
    client: httpx.AsyncClient, targets: Iterable[PodTarget], *, timeout_s: float = 2.0
) -> RouterDemand:
    """The router pods' demand, summed; incomplete when any read failed or there is none."""
    targets = list(targets)
    results = await asyncio.gather(*(_scrape_one(client, t, timeout_s) for t in targets))
    good = [r for r in results if r is not None]
    return RouterDemand(
        num_held=sum(r[0] for r in good),
        num_in_flight=sum(r[1] for r in good),
        num_requests=sum(r[2] for r in good),
        is_complete=bool(targets) and len(good) == len(targets),
    )
