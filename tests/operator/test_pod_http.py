"""Bounded reads of pod bodies: a fake pod that streams an endless body, fast or as a trickle,
costs the operator at most `max_bytes` and `timeout_s`, and reads as a failed probe/scrape."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from kubeinfer.operator.autoscale_types import PodTarget
from kubeinfer.operator.pod_http import PodReadError, bounded_get
from kubeinfer.operator.readiness import read_ready
from kubeinfer.operator.scrape import scrape_pod

pytestmark = pytest.mark.timeout(30)

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
Handler = Callable[[asyncio.StreamWriter], Awaitable[None]]


async def endless(writer: asyncio.StreamWriter) -> None:
    """No length, no end: 64 KiB chunks as fast as the reader takes them."""
    writer.write(HEAD + b"\r\n")
    chunk = b"vllm:num_requests_running 1\n" * 2300
    while True:
        writer.write(chunk)
        await writer.drain()


async def trickle(writer: asyncio.StreamWriter) -> None:
    """One byte every 50 ms, forever: never idle long enough for a read timeout."""
    writer.write(HEAD + b"\r\n")
    while True:
        writer.write(b"#")
        await writer.drain()
        await asyncio.sleep(0.05)


async def huge_length(writer: asyncio.StreamWriter) -> None:
    writer.write(HEAD + b"Content-Length: 100000000000\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(10)


async def small(writer: asyncio.StreamWriter) -> None:
    """A runtime's /ready while it loads."""
    body = b'{"status": "loading", "loaded_bytes": 5, "total_bytes": 10}'
    head = HEAD.replace(b"200 OK", b"503 Service Unavailable")
    writer.write(head + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()


async def serve(handler: Handler) -> AsyncIterator[tuple[str, int]]:
    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        try:
            await handler(writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield "127.0.0.1", port
    finally:
        server.close()


async def _with_server(
    handler: Handler, fn: Callable[[httpx.AsyncClient, str, int], Awaitable[object]]
) -> object:
    async for host, port in serve(handler):
        async with httpx.AsyncClient() as client:
            return await fn(client, host, port)
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("handler", "match"),
    [(endless, "body over 65536 bytes"), (trickle, "TimeoutError"), (huge_length, "over 65536")],
    ids=["endless", "trickle", "huge-length"],
)
def test_bounded_get_stops_at_the_bounds(handler: Handler, match: str) -> None:
    async def go(client: httpx.AsyncClient, host: str, port: int) -> object:
        return await bounded_get(client, f"http://{host}:{port}/x", max_bytes=65536, timeout_s=1)

    started = time.monotonic()
    with pytest.raises(PodReadError, match=match):
        asyncio.run(_with_server(handler, go))
    assert time.monotonic() - started < 3


def test_bounded_get_reads_a_small_body() -> None:
    async def go(client: httpx.AsyncClient, host: str, port: int) -> object:
        return await bounded_get(client, f"http://{host}:{port}/x", max_bytes=65536, timeout_s=1)

    status, body = asyncio.run(_with_server(small, go))  # type: ignore[misc]
    assert status == 503 and body.startswith(b'{"status": "loading"')


@pytest.mark.parametrize("handler", [endless, trickle], ids=["endless", "trickle"])
def test_ready_of_an_endless_pod_is_unreachable(handler: Handler) -> None:
    async def go(client: httpx.AsyncClient, host: str, port: int) -> object:
        return await read_ready(client, host, port, timeout_s=1)

    started = time.monotonic()
    report = asyncio.run(_with_server(handler, go))
    assert time.monotonic() - started < 3
    assert report.state == "unreachable"  # type: ignore[attr-defined]


def test_ready_of_a_loading_pod_is_read() -> None:
    async def go(client: httpx.AsyncClient, host: str, port: int) -> object:
        return await read_ready(client, host, port, timeout_s=1)

    report = asyncio.run(_with_server(small, go))
    assert (report.state, report.loaded_bytes, report.total_bytes) == ("loading", 5, 10)  # type: ignore[attr-defined]


@pytest.mark.parametrize("handler", [endless, trickle], ids=["endless", "trickle"])
def test_scrape_of_an_endless_pod_is_a_failed_sample(handler: Handler) -> None:
    async def go(client: httpx.AsyncClient, host: str, port: int) -> object:
        target = PodTarget("p", f"http://{host}:{port}/metrics")
        return await scrape_pod(client, target, timeout_s=1)

    started = time.monotonic()
    sample = asyncio.run(_with_server(handler, go))
    assert time.monotonic() - started < 3
    assert not sample.is_ok and sample.error  # type: ignore[attr-defined]
