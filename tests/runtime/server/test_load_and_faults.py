"""Bounded load and faults against a tiny random model: nothing lost, nothing leaked."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx
import pytest

from .conftest import Server, start_server, stop_server


def wait_idle(server: Server, timeout: float = 20) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
        if (idle and m["vllm:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


async def stream_completion(client: httpx.AsyncClient, body: dict) -> tuple[int, dict | None]:
    """Read one SSE stream; returns (number of text chunks, the usage chunk)."""
    chunks, usage, done = 0, None, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            assert "error" not in event, event
            if event["choices"]:
                chunks += 1
            if event.get("usage"):
                usage = event["usage"]
    assert done, "stream ended without [DONE]"
    return chunks, usage


@pytest.mark.timeout(600)
def test_1000_streams_at_concurrency_64(tiny_server: Server) -> None:
    before = tiny_server.metrics()
    rng = random.Random(0)
    bodies = [
        {
            "model": tiny_server.model_name,
            "prompt": f"request {i}: " + "word " * rng.randint(1, 40),
            "max_tokens": rng.randint(1, 24),
            "ignore_eos": True,
            "temperature": 0.8,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for i in range(1000)
    ]

    async def main() -> list[dict]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(
            base_url=tiny_server.url, headers=tiny_server.headers, timeout=120, limits=limits
        ) as client:
            gate = asyncio.Semaphore(64)

            async def one(body: dict) -> dict:
                async with gate:
                    _, usage = await stream_completion(client, body)
                    assert usage is not None
                    assert usage["completion_tokens"] == body["max_tokens"]
                    return usage

            return await asyncio.wait_for(asyncio.gather(*(one(b) for b in bodies)), 540)

    started = time.monotonic()
    usages = asyncio.run(main())
    elapsed = time.monotonic() - started
    assert len(usages) == 1000
    after = wait_idle(tiny_server)
    prompt_sum = sum(u["prompt_tokens"] for u in usages)
    completion_sum = sum(u["completion_tokens"] for u in usages)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta["vllm:generation_tokens_total"] == completion_sum
    assert delta["vllm:prompt_tokens_total"] == prompt_sum
    assert delta["vllm:request_success_total{finished_reason=length}"] == 1000
    assert after["vllm:kv_cache_usage_perc"] == 0 and after["vllm:num_requests_running"] == 0
    assert delta["vllm:e2e_request_latency_seconds_count"] == 1000
    print(f"1000 streams in {elapsed:.1f}s, {completion_sum / elapsed:.0f} output tok/s")


def test_50_disconnects_mid_stream_free_everything(tiny_server: Server) -> None:
    before = tiny_server.metrics()

    async def drop(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"disconnect {i}", "max_tokens": 100, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n == 2:
                    break  # leaving the block closes the connection mid-stream

    async def main() -> None:
        async with httpx.AsyncClient(
            base_url=tiny_server.url, headers=tiny_server.headers, timeout=60
        ) as client:
            await asyncio.gather(*(drop(client, i) for i in range(50)))

    asyncio.run(main())
    after = wait_idle(tiny_server)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    aborted = (
        after["vllm:request_success_total{finished_reason=abort}"]
        - before["vllm:request_success_total{finished_reason=abort}"]
    )
    assert aborted == 50


def test_sigterm_during_a_stream_completes_it_and_exits_0(tiny_chat_dir, tmp_path) -> None:  # noqa: ANN001
    server = start_server(
        tiny_chat_dir, tmp_path / "drain.log", "--max-model-len", "512", "--drain-timeout", "60"
    )
    try:
        body = {
            "prompt": "drain me",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        lines = []
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                it = r.iter_lines()
                for line in it:
                    lines.append(line)
                    if line.startswith("data: "):
                        break
                server.proc.send_signal(signal.SIGTERM)
                time.sleep(0.3)
                ready = httpx.get(f"{server.url}/ready", timeout=5)
                refused = httpx.post(
                    f"{server.url}/v1/completions", json={"prompt": "late"}, timeout=5
                )
                lines.extend(it)
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert [x for x in lines if x][-1] == "data: [DONE]"
        usage = json.loads([x for x in lines if '"usage"' in x][-1][6:])["usage"]
        assert usage["completion_tokens"] == 400
        assert server.proc.wait(60) == 0
    finally:
        stop_server(server)


def test_sigterm_keeps_serving_through_the_shutdown_delay(long_chat_dir, tmp_path) -> None:  # noqa: ANN001
    """For --shutdown-delay seconds /ready fails while requests are still served (endpoints
    drop the pod first); then new requests get 503 while the stream in flight finishes with
    [DONE], and the process exits 0."""
    server = start_server(
        long_chat_dir,
        tmp_path / "delay.log",
        "--num-kv-blocks", "256",
        "--shutdown-delay", "1",
        "--drain-timeout", "60",
    )  # fmt: skip
    body = {"prompt": "still here", "max_tokens": 2}
    long = {"prompt": "long", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=long) as stream:
                lines = stream.iter_lines()
                next(lines)
                server.proc.send_signal(signal.SIGTERM)
                time.sleep(0.3)
                assert httpx.get(f"{server.url}/ready", timeout=5).status_code == 503
                during = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
                assert during.status_code == 200, during.text
                time.sleep(1.2)
                after = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
                assert after.status_code == 503, after.text
                assert "shutting down" in after.json()["error"]["message"]
                rest = [x for x in lines if x]
        assert rest[-1] == "data: [DONE]"
        assert server.proc.wait(30) == 0
    finally:
        stop_server(server)
