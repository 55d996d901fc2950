"""Backend sources (static URLs, the file, ready pods from API JSON) and the hold queue."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kubeinfer.router.discovery import (
    Backend,
    InvalidBackendError,
    KubePodSource,
    StaticSource,
    parse_backend_url,
    ready_pod_backends,
)
from kubeinfer.router.hold import HoldQueue


def pod(name: str, ip: str | None, ready: bool, deleting: bool = False) -> dict:
    meta: dict = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_only_ready_running_pods_with_an_ip_route() -> None:
    pods = [
        pod("b", "127.1.0.2", True),
        pod("a", "127.1.0.1", True),
        pod("loading", "127.1.0.3", False),
        pod("leaving", "127.1.0.4", True, deleting=True),
        pod("pending", None, False),
    ]
    assert ready_pod_backends(pods, 8000) == [
        Backend("a", "http://127.1.0.1:8000"),
        Backend("b", "http://127.1.0.2:8000"),
    ]


def test_backend_urls_are_checked() -> None:
    assert parse_backend_url("http://127.0.0.1:8001/") == Backend(
        "127.0.0.1:8001", "http://127.0.0.1:8001"
    )
    for bad in ("127.0.0.1:8001", "ftp://h:1", "http://h:1/v1", "http://u@h:1"):
        with pytest.raises(InvalidBackendError):
            parse_backend_url(bad)


def test_the_backends_file_is_reread_and_bad_lines_skipped(tmp_path: Path) -> None:
    path = tmp_path / "backends"
    source = StaticSource(["http://127.0.0.1:1"], path)
    assert [b.name for b in asyncio.run(source.backends())] == ["127.0.0.1:1"]  # no file yet
    path.write_text("# pods\nhttp://127.0.0.1:2  # the second\nnot a url\n\nhttp://127.0.0.1:1\n")
    assert [b.name for b in asyncio.run(source.backends())] == ["127.0.0.1:1", "127.0.0.1:2"]


def test_held_requests_are_released_in_arrival_order() -> None:
    async def main() -> list[int]:
        queue, order = HoldQueue(), []

        async def waiter(i: int) -> None:
            assert await queue.wait(5)
            order.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(5)]
        await asyncio.sleep(0.01)
        assert len(queue) == 5
        assert queue.release_all() == 5
        await asyncio.gather(*tasks)
        assert len(queue) == 0
        return order

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]


def test_a_held_request_times_out_or_leaves_the_queue_when_cancelled() -> None:
    async def main() -> None:
        queue = HoldQueue()
        assert await queue.wait(0.01) is False
        assert len(queue) == 0
        task = asyncio.create_task(queue.wait(5))
        await asyncio.sleep(0.01)
        assert len(queue) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(queue) == 0 and queue.release_all() == 0

    asyncio.run(main())


def test_the_pod_source_lists_by_selector_from_the_api_cache() -> None:
    calls = []

    class FakeApi:
        async def request(self, method: str, path: str, *, query: dict) -> dict:
            calls.append((method, path, query))
            return {"items": [pod("m-0", "127.1.0.9", True), pod("m-1", "127.1.0.8", False)]}

    source = KubePodSource(FakeApi(), "models", "app.kubernetes.io/instance=m", 8000)
    assert asyncio.run(source.backends()) == [Backend("m-0", "http://127.1.0.9:8000")]
    assert calls == [
        (
            "GET",
            "/api/v1/namespaces/models/pods",
            {"labelSelector": "app.kubernetes.io/instance=m", "resourceVersion": "0"},
        )
    ]
