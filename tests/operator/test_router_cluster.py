"""A model's router on the dev cluster, end to end: the operator deploys it (routing mode router,
the default), it lists the model's pods with its own ServiceAccount's narrow Role, and chat
requests sent to the router pod reach a runtime pod, requests sharing a prefix the same one.

Every connection goes to a 127.x pod IP (never a Service's ClusterIP); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubeinfer.devcluster.testing import DevClusterHandle, wait_for
from tests.operator.conftest import example_model
from tests.operator.test_operator_cluster import READY_TIMEOUT_S, Cluster, operator_namespace
from tests.router.sse import read_sse

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

NAME = "routed"
RUNTIME = "app.kubernetes.io/name=kubeinfer-runtime"
ROUTER = "app.kubernetes.io/name=kubeinfer-router"
#: A system prompt longer than the router's prefix key (256 characters by default).
SYSTEM = "You are a terse assistant for a shipping company. " * 8


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = pod["status"].get("conditions") or []
    return not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conditions
    )


def pods(c: Cluster, app: str) -> list[dict[str, Any]]:
    found = c.dev.core.list_namespaced_pod(
        c.ns, label_selector=f"{app},app.kubernetes.io/instance={NAME}"
    )
    return [c.dev.api_client.sanitize_for_serialization(p) for p in found.items]


@pytest.fixture(scope="module")
def routed(
    dev_cluster: DevClusterHandle, tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Iterator[Cluster]:
    with operator_namespace(dev_cluster, "rt", tmp_path_factory.mktemp("router")) as c:
        model = example_model(smollm2_dir.resolve(), c.ns)
        model["metadata"]["name"] = NAME
        model["spec"]["replicas"] = 2
        c.apply_model(model)
        yield c


def router_url(c: Cluster) -> str:
    def ready_router() -> str | None:
        ready = [p for p in pods(c, ROUTER) if is_ready(p)]
        return f"http://{ready[0]['status']['podIP']}:8000" if ready else None

    url = wait_for(ready_router, timeout_s=60, what="a Ready router pod")
    assert url.startswith("http://127.")  # a loopback pod IP, never the ClusterIP
    return url


def router_pods(url: str) -> float:
    """How many runtime pods the router routes to (it lists them every 2 s)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kubeinfer_router_pods":
                return sample.value
    return 0.0


def wait_router_pods(url: str, n: int) -> None:
    wait_for(lambda: router_pods(url) == n, timeout_s=30, what=f"the router routing to {n} pods")


def chat(url: str, user: str) -> httpx.Response:
    body = {
        "model": "smollm2",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "temperature": 0,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def test_the_operator_deploys_the_router_and_points_the_endpoint_at_it(routed: Cluster) -> None:
    c = routed
    status = c.wait_phase(NAME, "Ready", READY_TIMEOUT_S, readyReplicas=2)
    assert status["endpoint"] == f"http://{NAME}.{c.ns}.svc:8000/v1"
    service = c.get("Service", NAME)
    assert service is not None
    (router_pod, *_) = wait_for(lambda: pods(c, ROUTER), timeout_s=30, what="router pods")
    labels = router_pod["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()  # the endpoint is the router's
    spec = router_pod["spec"]
    assert spec["serviceAccountName"] == f"{NAME}-router"
    assert not any("nvidia.com/gpu" in (ct["resources"].get("limits") or {})
                   for ct in spec["containers"])  # fmt: skip
    router_url(c)  # its /ready: it has listed pods with its own token and Role
    out = c.dev.kubectl("get", "im", NAME, "-n", c.ns)
    header, row = out.strip().splitlines()
    assert "ENDPOINT" in header.split()
    assert f"http://{NAME}.{c.ns}.svc:8000/v1" in row.split()


def test_a_chat_request_through_the_router_pod_is_served_by_a_model_pod(routed: Cluster) -> None:
    c = routed
    url = router_url(c)
    names = {p["metadata"]["name"] for p in pods(c, RUNTIME) if is_ready(p)}
    assert len(names) == 2

    # the router lists pods every 2 s: wait until it routes at all
    def served() -> httpx.Response | None:
        response = chat(url, "Hello!")
        return response if response.status_code == 200 else None

    response = wait_for(served, timeout_s=30, what="a 200 through the router")
    assert response.json()["choices"][0]["message"]["content"]
    assert response.headers["x-kubeinfer-pod"] in names


def test_requests_sharing_a_prefix_land_on_the_same_pod(routed: Cluster) -> None:
    c = routed
    url = router_url(c)
    wait_router_pods(url, 2)  # else the first request may go to the only pod it knows yet
    served_by = []
    for i in range(4):  # one at a time: no pod is loaded, so affinity decides
        response = chat(url, f"Where is parcel {i}?")
        assert response.status_code == 200, response.text[:300]
        served_by.append(response.headers["x-kubeinfer-pod"])
    assert len(set(served_by)) == 1, served_by
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert "kubeinfer_router_" in metrics


async def _stream(
    client: httpx.AsyncClient, session: str, started: asyncio.Event, counter: list[int], n: int
) -> tuple[str, bool]:
    """One long streamed completion through the router: (pod, finished with every token)."""
    body = {
        "model": "smollm2", "prompt": "Tell a long story about a lighthouse.",
        "max_tokens": 160, "ignore_eos": True, "temperature": 0, "stream": True,
    }  # fmt: skip
    def first() -> None:
        counter[0] += 1
        if counter[0] == n:
            started.set()

    async with client.stream(
        "POST", "/v1/completions", json=body, headers={"x-session-id": session}
    ) as r:
        assert r.status_code == 200, await r.aread()
        return r.headers["x-kubeinfer-pod"], (await read_sse(r, first)).complete


def test_a_runtime_pod_killed_mid_stream_fails_only_its_streams(routed: Cluster) -> None:
    """Six long streams through the router pod spread over both runtime pods (bounded load);
    one runtime pod's server is SIGKILLed once every stream has its first token: the streams
    it served fail, every other one ends with all its tokens, the next requests are served by
    the survivor, and the killed container comes back (restartPolicy Always)."""
    c = routed
    url = router_url(c)
    c.wait_phase(NAME, "Ready", READY_TIMEOUT_S, readyReplicas=2)
    wait_router_pods(url, 2)
    runtime = {p["metadata"]["name"]: p for p in pods(c, RUNTIME) if is_ready(p)}
    assert len(runtime) == 2
    num_streams = 6

    async def main() -> tuple[str, list[tuple[str, bool]]]:
        started, counter = asyncio.Event(), [0]
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            tasks = [
                asyncio.create_task(_stream(client, f"kill-{i}", started, counter, num_streams))
                for i in range(num_streams)
            ]
            await asyncio.wait_for(started.wait(), 120)
            victim = sorted(runtime)[0]
            pid = int(runtime[victim]["status"]["containerStatuses"][0]["containerID"]
                      .removeprefix("dev://"))  # fmt: skip
            os.kill(pid, signal.SIGKILL)
            return victim, await asyncio.wait_for(asyncio.gather(*tasks), 300)

    victim, results = asyncio.run(main())
    on_victim = [ok for pod, ok in results if pod == victim]
    on_survivor = [ok for pod, ok in results if pod != victim]
    assert on_victim and on_survivor, results  # bounded load spread the sessions
    assert all(on_survivor), results  # every token, to finish_reason "length"
    assert not any(on_victim), results
    survivor = next(name for name in runtime if name != victim)
    for i in range(3):  # the dead server refuses connections: retried on the survivor
        response = chat(url, f"After the crash {i}?")
        assert response.status_code == 200, response.text[:300]
    wait_for(
        lambda: sum(is_ready(p) for p in pods(c, RUNTIME)) == 2, timeout_s=READY_TIMEOUT_S,
        what="the killed pod Ready again",
    )  # fmt: skip
    restarted = next(p for p in pods(c, RUNTIME) if p["metadata"]["name"] == victim)
    assert restarted["status"]["containerStatuses"][0]["restartCount"] >= 1
    assert survivor in {p["metadata"]["name"] for p in pods(c, RUNTIME)}


def test_a_pod_leaving_stops_receiving_traffic_without_failing_requests(routed: Cluster) -> None:
    """Scaled to 1, one pod terminates: its /ready fails within the shutdown delay, the router
    drops it from its next listing, and requests sent meanwhile all succeed on the pods it
    still routes to."""
    c = routed
    url = router_url(c)
    before = {p["metadata"]["name"] for p in pods(c, RUNTIME) if is_ready(p)}
    assert len(before) == 2
    c.dev.kubectl("scale", "im", NAME, "-n", c.ns, "--replicas", "1")
    codes, served_by = [], []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(codes) < 12:  # through the pod's whole drain
        response = chat(url, f"Is parcel {len(codes)} late?")
        codes.append(response.status_code)
        served_by.append(response.headers.get("x-kubeinfer-pod"))
    assert codes and set(codes) == {200}, codes
    (remaining,) = wait_for(
        lambda: (names := {p["metadata"]["name"] for p in pods(c, RUNTIME)}) and len(names) == 1
        and names,
        timeout_s=90, what="one runtime pod left",
    )  # fmt: skip
    for i in range(3):
        response = chat(url, f"And parcel {i}?")
        assert response.status_code == 200
        assert response.headers["x-kubeinfer-pod"] == remaining
    assert set(served_by) <= before
