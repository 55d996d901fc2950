"""Scale from zero and back on the dev cluster: a model at 0 replicas behind its router.

The router holds the first requests (at most `maxHeldRequests`, the next one gets 503 with
Retry-After at once), the autoscaler sees them held and asks for a replica without waiting a
window, and every held request is answered once it is Ready; after `scaleToZeroAfterSeconds`
without a request the model goes back to 0. Connections go to 127.x pod IPs only; the number
of requests and every wait are bounded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kubeinfer.devcluster.testing import DevClusterHandle, wait_for
from kubeinfer.operator.router_scrape import parse_router_metrics
from tests.operator.conftest import example_model
from tests.operator.test_operator_cluster import READY_TIMEOUT_S, Cluster, operator_namespace
from tests.operator.test_router_cluster import ROUTER, is_ready

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

NAME = "scaled"
MAX_HELD = 5
IDLE_S = 20


@pytest.fixture(scope="module")
def zero(
    dev_cluster: DevClusterHandle, tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Iterator[Cluster]:
    with operator_namespace(dev_cluster, "zero", tmp_path_factory.mktemp("zero")) as c:
        model = example_model(smollm2_dir.resolve(), c.ns, autoscaling=True)
        model["metadata"]["name"] = NAME
        model["spec"]["replicas"] = 0
        model["spec"]["autoscaling"] |= {
            "minReplicas": 0, "maxReplicas": 1, "scaleToZeroAfterSeconds": IDLE_S,
        }  # fmt: skip
        model["spec"]["routing"] = {"maxHeldRequests": MAX_HELD, "maxHoldSeconds": READY_TIMEOUT_S}
        c.apply_model(model)
        yield c


def router_url(c: Cluster) -> str:
    def ready() -> str | None:
        found = c.dev.core.list_namespaced_pod(
            c.ns, label_selector=f"{ROUTER},app.kubernetes.io/instance={NAME}"
        )
        pods = [c.dev.api_client.sanitize_for_serialization(p) for p in found.items]
        up = [p for p in pods if is_ready(p)]
        return f"http://{up[0]['status']['podIP']}:8000" if up else None

    url = wait_for(ready, timeout_s=60, what="a Ready router pod")
    assert url.startswith("http://127.")
    return url


def num_held(url: str) -> int:
    return parse_router_metrics(httpx.get(f"{url}/metrics", timeout=5).text)[0]


def chat(url: str, i: int) -> httpx.Response:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": f"Say {i}."}],
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=READY_TIMEOUT_S + 30)


def test_held_requests_are_served_after_the_cold_start_and_one_more_gets_503(
    zero: Cluster,
) -> None:
    c = zero
    url = router_url(c)
    assert c.model(NAME)["spec"]["replicas"] == 0
    assert not c.pods(NAME)  # no runtime pod at all
    started = time.monotonic()
    with ThreadPoolExecutor(MAX_HELD) as pool:
        futures = [pool.submit(chat, url, i) for i in range(MAX_HELD)]
        wait_for(lambda: num_held(url) == MAX_HELD, timeout_s=30, what=f"{MAX_HELD} held")
        over = chat(url, MAX_HELD)  # the bound is full: refused at once, never queued
        assert over.status_code == 503, over.text[:300]
        assert int(over.headers["retry-after"]) >= 1
        responses = [f.result() for f in futures]
    cold_start_s = time.monotonic() - started
    assert [r.status_code for r in responses] == [200] * MAX_HELD, [r.text[:200] for r in responses]
    assert all(r.json()["choices"][0]["message"]["content"] for r in responses)
    model = c.model(NAME)
    assert model["spec"]["replicas"] == 1
    history = model["status"]["scalingHistory"]
    assert history[-1]["from"] == 0 and history[-1]["to"] == 1
    assert "held" in history[-1]["reason"]
    print(f"cold start: {cold_start_s:.1f}s for {MAX_HELD} held requests")  # noqa: T201


def test_an_idle_model_scales_back_to_zero(zero: Cluster) -> None:
    c = zero
    started = time.monotonic()
    wait_for(lambda: c.model(NAME)["spec"]["replicas"] == 0, timeout_s=IDLE_S + 40,
             what="spec.replicas back to 0")  # fmt: skip
    assert time.monotonic() - started >= IDLE_S - 10  # not before the idle period (less the
    # time the first test's last request already counts)
    # the autoscaler writes spec.replicas, then its status: wait for that too (CI once read the
    # status between both writes)
    last = wait_for(
        lambda: (h := c.model(NAME)["status"].get("scalingHistory")) and h[-1]["to"] == 0 and h[-1],
        timeout_s=10, what="the scale to zero in scalingHistory",
    )  # fmt: skip
    assert "to zero" in last["reason"]
    dep = wait_for(lambda: (d := c.get("Deployment", NAME)) and d["spec"]["replicas"] == 0 and d,
                   timeout_s=30, what="the Deployment at 0")  # fmt: skip
    assert dep["spec"]["replicas"] == 0
    wait_for(lambda: not c.pods(NAME), timeout_s=90, what="the runtime pod gone")
    router_url(c)  # the router stays, ready to hold the next request
