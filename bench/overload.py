"""Overload: a flood of impatient clients against a small queue bound, then a normal request.

Starts `kubeinfer serve` (SmolLM2, float32, CPU) with a small waiting-queue bound, measures
`/health` on the idle server (the baseline), then sends `--requests` concurrent completions
whose clients give up after `--client-timeout` seconds while another client polls `/health`.
Prints how many were accepted (completed), refused with 429, or timed out; how long the queue
took to drain after the last client left; `/health` p50/p99 during the flood beside the idle
baseline (and their ratio); the KV blocks free afterwards; and a normal request's status.
Goals: every KV block free, drained within 10 s of the last client leaving, `/health` p99
under 100 ms. Appends a row to bench/RESULTS.md.

    python bench/overload.py [--model .cache/models/smollm2-135m] [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

RESULTS = Path(__file__).with_name("RESULTS.md")


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels.keys() - {"model_name"}
    }


def poll_health(url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            start = time.perf_counter()
            client.get(f"{url}/health")
            out.append(time.perf_counter() - start)
            time.sleep(0.02)


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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [
            sys.executable, "-m", "kubeinfer", "serve",
            "--model", str(args.model),
            "--port", str(args.port),
            "--dtype", "float32",
            "--num-kv-blocks", "1024",
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-queued-requests", str(args.max_queued_requests),
            "--log-level", "warning",
        ]  # fmt: skip
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit("server did not become ready in 300 s")
        httpx.post(f"{url}/v1/completions", json={"prompt": "warm up"}, timeout=60)

        idle: list[float] = []
        stop = threading.Event()
        poller = threading.Thread(target=poll_health, args=(url, stop, idle))
        poller.start()
        time.sleep(3)
        stop.set()
        poller.join()

        during: list[float] = []
        stop = threading.Event()
        poller = threading.Thread(target=poll_health, args=(url, stop, during))
        poller.start()
        started = time.monotonic()
        outcomes, last_left = asyncio.run(flood(url, args))
        flood_s = time.monotonic() - started
        drain_after_last_s = max(0.0, wait_drained(url, timeout=60) - last_left)
        stop.set()
        poller.join()
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
    print(
        f"/health during the flood: p50 {health_p50 * 1e3:.1f} ms, p99 {health_p99 * 1e3:.1f} ms"
        f" over {len(during)} polls (goal p99 < 100 ms); idle p99 {idle_p99 * 1e3:.1f} ms"
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
                f"{drain_after_last_s:.2f} s after the last client; /health p50 "
                f"{health_p50 * 1e3:.1f} ms p99 {health_p99 * 1e3:.1f} ms; KV usage after "
                f"{usage:g}; next request {normal.status_code} | idle /health p99 "
                f"{idle_p99 * 1e3:.1f} ms | /health p99 ratio {health_p99 / idle_p99:.1f} "
                f"(goals: drain <= 10 s, p99 < 100 ms, all free: {'met' if met else 'missed'}) |\n"
            )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
