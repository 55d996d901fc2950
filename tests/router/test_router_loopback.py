"""The router in front of two real `kubeinfer serve` processes (tiny chat model, loopback):
affinity, pass-through, retries, a pod killed mid-stream, disconnects, the hold queue.

Every load here is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.runtime.server.conftest import Server, free_port, start_server, stop_server

from .conftest import SERVER_ARGS, Router
from .sse import read_sse

pytestmark = pytest.mark.timeout(300)

SHARED = "You are a helpful assistant who answers briefly and precisely. " * 8  # 512 chars


def completion(server_name: str, prompt: str, **extra: object) -> dict:
    return {"model": server_name, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}


def test_requests_sharing_a_prefix_land_on_one_pod(
    two_servers: list[Server], router_factory
) -> None:  # noqa: ANN001
    router: Router = router_factory(*(s.url for s in two_servers))
    name = two_servers[0].model_name
    with httpx.Client(base_url=router.url, timeout=60) as client:
        pods = set()
        for i in range(6):
            r = client.post("/v1/completions", json=completion(name, f"{SHARED} question {i}"))
            assert r.status_code == 200, r.text
            pods.add(r.headers["x-kubeinfer-pod"])
        assert len(pods) == 1

        def other(i: int) -> str:
            r = client.post("/v1/completions", json=completion(name, f"{i} {SHARED}"))
            assert r.status_code == 200, r.text
            return r.headers["x-kubeinfer-pod"]

        # other prefixes, 8 at a time: each new one goes to the less loaded pod, so both take
        # some (one by one, a scrape that caught a pod busy could send all 16 to the other)
        with ThreadPoolExecutor(8) as pool:
            spread = set(pool.map(other, range(16)))
        assert len(spread) == 2
    m = router.metrics()
    assert m["kubeinfer_router_decisions_total{reason=prefix}"] == 22
    served = sum(v for k, v in m.items() if k.startswith("kubeinfer_router_requests_total"))
    assert served == 22


def test_streams_errors_and_models_pass_through_unchanged(
    two_servers: list[Server], router_factory
) -> None:  # noqa: ANN001
    server = two_servers[0]
    router: Router = router_factory(server.url)
    body = completion(
        server.model_name,
        "Once upon a time",
        max_tokens=12,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )

    def events(base: str) -> tuple[int, str, list[dict]]:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            ctype = r.headers["content-type"]
        assert lines[-1] == "data: [DONE]"
        return r.status_code, ctype, [json.loads(line[6:]) for line in lines[:-1]]

    direct, routed = events(server.url), events(router.url)
    assert routed[:2] == direct[:2] and routed[1].startswith("text/event-stream")
    text = "".join(e["choices"][0]["text"] for e in routed[2] if e["choices"])
    assert text == "".join(e["choices"][0]["text"] for e in direct[2] if e["choices"])
    assert routed[2][-1]["usage"] == direct[2][-1]["usage"]  # the usage chunk, as the pod sent it
    bad = {"model": server.model_name, "prompt": "x", "max_tokens": -1}
    a = httpx.post(f"{server.url}/v1/completions", json=bad)
    b = httpx.post(f"{router.url}/v1/completions", json=bad)
    assert (b.status_code, b.json()) == (a.status_code, a.json()) and a.status_code == 400
    models = httpx.get(f"{router.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [server.model_name]
    assert httpx.get(f"{router.url}/v1/nothing").status_code == 404


def test_a_pod_down_before_connect_is_retried_on_another(
    two_servers: list[Server], router_factory
) -> None:  # noqa: ANN001
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    live = two_servers[0]
    # no stale penalty: the dead pod (never scraped) is as good as the live one, so new
    # sessions go by rendezvous order and about half try the dead one first
    router: Router = router_factory(dead, live.url, args=("--stale-penalty", "0"))
    with httpx.Client(base_url=router.url, timeout=60) as client:
        for i in range(12):
            r = client.post(
                "/v1/completions",
                json=completion(live.model_name, "hello"),
                headers={"x-session-id": f"session-{i}"},
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-kubeinfer-pod"] == live.url.removeprefix("http://")
    m = router.metrics()
    assert m["kubeinfer_router_upstream_retries_total"] >= 1
    assert m[f"kubeinfer_router_pod_stale{{pod={dead.removeprefix('http://')}}}"] == 1


def test_a_pod_killed_mid_stream_fails_only_its_streams(
    two_servers: list[Server],
    chat_model_dir: Path,
    tmp_path: Path,
    router_factory,  # noqa: ANN001
) -> None:
    victim = start_server(chat_model_dir, tmp_path / "victim.log", *SERVER_ARGS)
    survivor = two_servers[1]
    router: Router = router_factory(victim.url, survivor.url)
    victim_pod = victim.url.removeprefix("http://")
    body = completion(
        survivor.model_name, "Tell a story", max_tokens=300, ignore_eos=True, stream=True
    )

    async def one(
        client: httpx.AsyncClient, i: int, started: asyncio.Event, counter: list[int]
    ) -> tuple[str, int, bool, bool]:
        headers = {"x-session-id": f"s{i}"}
        def first() -> None:
            counter[0] += 1
            if counter[0] == 8:
                started.set()

        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            pod = r.headers["x-kubeinfer-pod"]
            end = await read_sse(r, first)
        return pod, end.chunks, end.done, end.errored or not end.finished

    async def main() -> list[tuple[str, int, bool, bool]]:
        started, counter = asyncio.Event(), [0]
        async with httpx.AsyncClient(base_url=router.url, timeout=120) as client:
            tasks = [asyncio.create_task(one(client, i, started, counter)) for i in range(8)]
            await asyncio.wait_for(started.wait(), 60)
            victim.proc.send_signal(signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 240)

    try:
        results = asyncio.run(main())
    finally:
        stop_server(victim)
    on_victim = [r for r in results if r[0] == victim_pod]
    on_survivor = [r for r in results if r[0] != victim_pod]
    assert on_victim and on_survivor, results  # 8 sessions over 2 pods
    for _, _, done, failed in on_survivor:  # every token, to finish_reason "length"
        assert done and not failed
    for _, _, _, failed in on_victim:
        assert failed
    # new requests keep working: the dead pod refuses connections, retried elsewhere
    for i in range(4):
        r = httpx.post(
            f"{router.url}/v1/completions",
            json=completion(survivor.model_name, "again"),
            headers={"x-session-id": f"s{i}"},
            timeout=60,
        )
        assert r.status_code == 200 and r.headers["x-kubeinfer-pod"] != victim_pod


def test_a_client_leaving_cancels_its_request_on_the_pod(
    two_servers: list[Server], router_factory
) -> None:  # noqa: ANN001
    server = two_servers[0]
    router: Router = router_factory(server.url)
    body = completion(server.model_name, "Go on", max_tokens=3000, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 10
    while server.metrics()["vllm:num_requests_running"] != 0:
        assert time.monotonic() < deadline, "the pod kept generating for a client that left"
        time.sleep(0.1)
    success = server.metrics()
    assert success["vllm:request_success_total{finished_reason=abort}"] >= 1


def test_held_requests_wait_for_a_pod_and_the_one_past_the_bound_gets_503(
    two_servers: list[Server],
    router_factory,  # noqa: ANN001
) -> None:
    router: Router = router_factory(args=("--max-held-requests", "3", "--retry-after-s", "7"))
    server = two_servers[0]
    body = completion(server.model_name, "held")

    async def main() -> tuple[list[httpx.Response], httpx.Response, float]:
        async with httpx.AsyncClient(base_url=router.url, timeout=60) as client:
            held = [
                asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(3)
            ]
            deadline = time.monotonic() + 10
            while router.metrics()["kubeinfer_router_held_requests"] < 3:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            over = await client.post("/v1/completions", json=body)
            assert not any(t.done() for t in held)
            released = time.monotonic()
            router.set_backends(server.url)
            return list(await asyncio.gather(*held)), over, released

    responses, over, _ = asyncio.run(main())
    assert over.status_code == 503 and over.headers["retry-after"] == "7"
    assert "already held" in over.json()["error"]["message"]
    assert [r.status_code for r in responses] == [200, 200, 200]
    m = router.metrics()
    assert m["kubeinfer_router_held_requests"] == 0
    assert m["kubeinfer_router_hold_seconds_count"] == 3
    assert m["kubeinfer_router_requests_total{code=503,pod=none}"] == 1


def test_a_held_request_times_out_with_503_and_big_bodies_get_413(router_factory) -> None:  # noqa: ANN001
    router: Router = router_factory(args=("--max-hold-s", "0.5", "--max-request-bytes", "2048"))
    r = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert "no ready pod within 0.5s" in r.json()["error"]["message"]
    big = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x" * 4000}, timeout=10)
    assert big.status_code == 413
    assert httpx.get(f"{router.url}/health").status_code == 200
