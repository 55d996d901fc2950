"""Overload: a flood of impatient clients against a small queue bound, then a normal request.

Starts `kubeinfer serve` (SmolLM2, float32, CPU) with a small waiting-queue bound and a probe
port (as the operator renders it), measures `/health` on the idle server (the baseline), then
sends `--requests` concurrent completions whose clients give up after `--client-timeout`
seconds while two more clients poll `/health`: on the probe port (what the kubelet asks) and on
the API port (beside the flood). Prints how many requests were accepted (completed), refused
with 429, or timed out; how long the queue took to drain after the last client left; `/health`
p50/p99 on both ports beside the idle baseline; the KV blocks free afterwards; and a normal
request's status. Goals: every KV block free, drained within 10 s of the last client leaving,
`/health` p99 under 100 ms on the probe port. Appends a row to bench/RESULTS.md.

    python bench/overload.py [--model .cache/models/smollm2-135m] [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import multiprocessing
import random
import statistics
import sys
import time
from collections import Counter
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as EventType
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from servers import start_server

RESULTS = Path(__file__).with_name("RESULTS.md")


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels.keys() - {"model_name"}
    }


def poll_health(url: str, stop: EventType, out: Queue) -> None:
    """GET /health every 20 ms until `stop`; the latencies go to `out` at the end. Runs in a
    process of its own, so the flooding client's GIL never delays its measurements."""
    latencies = []
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            start = time.perf_counter()
            client.get(f"{url}/health")
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
    out.put(latencies)


class Poller:
    """`poll_health` in a child process: `with Poller(url) as p: ...`, then `p.latencies`."""

    def __init__(self, url: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop, self._out = ctx.Event(), ctx.Queue()
        self._proc = ctx.Process(target=poll_health, args=(url, self._stop, self._out))
        self.latencies: list[float] = []

    def __enter__(self) -> Poller:
        self._proc.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self.latencies = self._out.get(timeout=60)
        self._proc.join(30)


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


async def flood(url: str, args: argparse.Namespace) -> tuple[Counter[str], float]:
    """Every request at once; returns the outcomes and when the last client left."""
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.requests, max_keepalive_connections=0)
    outcomes: Counter[str] = Counter()
    last_left = 0.0
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:

        async def one(i: int) -> None:
            nonlocal last_left
            body = {
                "prompt": [rng.randrange(100, 5000) for _ in range(rng.randint(16, 128))],
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
            }
            try:
                r = await client.post("/v1/completions", json=body, timeout=args.client_timeout)
                outcomes[str(r.status_code)] += 1
            except httpx.TimeoutException:
                outcomes["timed out"] += 1
            except httpx.HTTPError as e:
                outcomes[type(e).__name__] += 1
            last_left = max(last_left, time.monotonic())

        await asyncio.gather(*(one(i) for i in range(args.requests)))
    return outcomes, last_left


def wait_drained(url: str, timeout: float) -> float:
    """When (monotonic) the engine was first seen with nothing running or waiting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = gauges(url)
        if m["vllm:num_requests_waiting"] == 0 and m["vllm:num_requests_running"] == 0:
            return time.monotonic()
        time.sleep(0.05)
    return float("inf")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=Path(".cache/models/smollm2-135m"))
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--client-timeout", type=float, default=2.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-queued-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--port", type=int, default=18741)
    parser.add_argument("--probe-port", type=int, default=18742)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    probe_url = f"http://127.0.0.1:{args.probe_port}"
    server = start_server(
        args.model,
        args.port,
        "--dtype", "float32",
        "--num-kv-blocks", "1024",
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-queued-requests", str(args.max_queued_requests),
        "--probe-port", str(args.probe_port),
    )  # fmt: skip
    try:
        httpx.post(f"{url}/v1/completions", json={"prompt": "warm up"}, timeout=60)

        with Poller(probe_url) as idle_poller:
            time.sleep(3)
        idle = idle_poller.latencies
        # on the probe port (what the kubelet asks) and on the API port, behind the flood
        with Poller(probe_url) as probe_poller, Poller(url) as api_poller:
            time.sleep(1)  # both started (a spawned process takes a moment)
            started = time.monotonic()
            outcomes, last_left = asyncio.run(flood(url, args))
            flood_s = time.monotonic() - started
            drain_after_last_s = max(0.0, wait_drained(url, timeout=60) - last_left)
        during, during_api = probe_poller.latencies, api_poller.latencies
        normal = httpx.post(
            f"{url}/v1/completions", json={"prompt": "after the flood", "max_tokens": 8}, timeout=60
        )
        after = gauges(url)
    finally:
        server.terminate()
        server.wait(60)

    usage = after["vllm:kv_cache_usage_perc"]
    health_p50, health_p99 = statistics.median(during), p99(during)
    idle_p99 = p99(idle)
    print(f"{args.requests} requests in {flood_s:.1f} s, client timeout {args.client_timeout} s:")
    print(f"  accepted {outcomes['200']}, 429 {outcomes['429']}, timed out {outcomes['timed out']}")
    print(f"  all outcomes: {dict(outcomes)}")
    print(f"queue drained {drain_after_last_s:.2f} s after the last client left (goal <= 10 s)")
    api_p50, api_p99 = statistics.median(during_api), p99(during_api)
    print(
        f"/health on the probe port during the flood: p50 {health_p50 * 1e3:.1f} ms, p99 "
        f"{health_p99 * 1e3:.1f} ms over {len(during)} polls (goal p99 < 100 ms); idle p99 "
        f"{idle_p99 * 1e3:.1f} ms"
    )
    print(
        f"/health on the API port during the flood: p50 {api_p50 * 1e3:.1f} ms, p99 "
        f"{api_p99 * 1e3:.1f} ms over {len(during_api)} polls"
    )
    print(f"KV cache usage after: {usage} (goal 0); a normal request after: {normal.status_code}")
    met = usage == 0 and drain_after_last_s <= 10 and health_p99 < 0.1 and normal.is_success
    print(f"goals {'met' if met else 'MISSED'}")
    if not args.no_results:
        with RESULTS.open("a") as f:
            f.write(
                f"| {dt.date.today()} | overload | SmolLM2 fp32 CPU, {args.requests} concurrent, "
                f"client timeout {args.client_timeout} s, queue bound {args.max_queued_requests},"
                f" max-num-seqs {args.max_num_seqs} | accepted {outcomes['200']}, 429 "
                f"{outcomes['429']}, timed out {outcomes['timed out']}; drained "
                f"{drain_after_last_s:.2f} s after the last client; /health on the probe port "
                f"p50 {health_p50 * 1e3:.1f} ms p99 {health_p99 * 1e3:.1f} ms (API port p50 "
                f"{api_p50 * 1e3:.1f} ms p99 {api_p99 * 1e3:.1f} ms); KV usage after "
                f"{usage:g}; next request {normal.status_code} | idle /health p99 "
                f"{idle_p99 * 1e3:.1f} ms | /health p99 ratio {health_p99 / idle_p99:.1f} "
                f"(goals: drain <= 10 s, p99 < 100 ms, all free: {'met' if met else 'missed'}) |\n"
            )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
