"""The autoscaler reads the router's demand: its /metrics as the router renders them, scraped
over loopback (bounded), and a daemon tick that scales from zero on it."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kubeinfer.operator.autoscale_daemon import autoscale_tick, new_memory, settings_from_spec
from kubeinfer.operator.autoscale_types import PodTarget, RouterDemand
from kubeinfer.operator.router_scrape import (
    RouterMetricsError,
    parse_router_metrics,
    scrape_routers,
)
from kubeinfer.router.metrics import RouterMetrics
from kubeinfer.router.routing_types import PodView
from tests.operator.test_autoscaler_daemon import WALL, FakeCluster, model_spec


def router_text(num_held: int, in_flight: dict[str, int], requests: dict[str, int]) -> str:
    """/metrics as the router itself renders them."""
    views = [PodView(name, num_in_flight=n) for name, n in in_flight.items()]
    metrics = RouterMetrics(lambda: views, lambda: num_held)
    for pod, count in requests.items():
        for _ in range(count):
            metrics.observe_request(pod, 200)
    return metrics.render().decode()


def test_parse_sums_in_flight_and_requests_over_pods_and_codes() -> None:
    text = router_text(3, {"a": 2, "b": 1}, {"a": 4, "none": 1})
    assert parse_router_metrics(text) == (3, 3, 5.0)


@pytest.mark.parametrize(
    "body",
    [
        "",
        "# HELP x y\nx 1\n",
        "not prometheus {{{",
        # a bug: values int() cannot take raised ValueError/OverflowError past the scrape's
        # except, and failed the whole autoscaler tick instead of that pod's read
        "kubeinfer_router_held_requests NaN\n",
        "kubeinfer_router_held_requests +Inf\n",
        'kubeinfer_router_held_requests 0\nkubeinfer_router_pod_in_flight{pod="a"} Inf\n',
        'kubeinfer_router_held_requests 0\nkubeinfer_router_requests_total{pod="a"} NaN\n',
    ],
)
def test_parse_refuses_what_is_not_a_router(body: str) -> None:
    with pytest.raises(RouterMetricsError):
        parse_router_metrics(body)


class _Handler(BaseHTTPRequestHandler):
    text = ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        status = 500 if self.path == "/broken" else 200
        body = self.text.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def router_server() -> Iterator[str]:
    _Handler.text = router_text(2, {"a": 1}, {"a": 7})
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def scrape(targets: list[PodTarget]) -> RouterDemand:
    async def go() -> RouterDemand:
        async with httpx.AsyncClient() as client:
            return await scrape_routers(client, targets, timeout_s=0.5)

    return asyncio.run(go())


@pytest.mark.timeout(30)
def test_scrape_routers_sums_pods_and_marks_a_failure_incomplete(router_server: str) -> None:
    two = [PodTarget("r1", f"{router_server}/metrics"), PodTarget("r2", f"{router_server}/m")]
    assert scrape(two) == RouterDemand(4, 2, 14.0, is_complete=True)
    broken = [*two, PodTarget("r3", f"{router_server}/broken")]
    assert scrape(broken) == RouterDemand(4, 2, 14.0, is_complete=False)
    refused = [PodTarget("r4", "http://127.0.0.1:9/metrics")]
    assert scrape(refused).is_complete is False
    assert scrape([]).is_complete is False  # no router pod ready: nothing is known


def test_a_tick_at_zero_replicas_scales_to_one_on_held_requests() -> None:
    spec = model_spec(replicas=0, minReplicas=0, scaleToZeroAfterSeconds=30)
    cluster = FakeCluster(spec, num_ready=0, rate=0)
    memory = new_memory(settings_from_spec(spec))
    demand = RouterDemand(0, 0, 0.0, True)

    async def scrape_router() -> RouterDemand:
        return demand

    def tick() -> None:
        asyncio.run(
            autoscale_tick(
                spec=cluster.spec, selector="app.kubernetes.io/instance=m", api=cluster,
                scrape=cluster.scrape, memory=memory, now=cluster.now,
                wall_now=WALL + dt.timedelta(seconds=cluster.now), scrape_router=scrape_router,
            )
        )  # fmt: skip
        cluster.now += 2

    tick()
    assert cluster.scaled == []  # nothing held: stays at zero
    demand = RouterDemand(5, 0, 0.0, True)
    tick()
    assert cluster.scaled == [1]
    assert cluster.events[-1][1].startswith("scaled 0 -> 1: from zero: 5 requests held")
    assert settings_from_spec(spec).policy.scale_to_zero_after_s == 30.0
