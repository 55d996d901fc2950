"""Scraping and windows: the runtime's metric text, a fake metrics server on 127.0.0.1, rates."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kubeinfer.operator.autoscale_types import PodSample, PodTarget
from kubeinfer.operator.scrape import MetricsParseError, SampleStore, parse_metrics, scrape_pods

TEXT = """\
# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# HELP vllm:num_requests_waiting Requests waiting to be scheduled.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 2.0
vllm:num_requests_waiting{model_name="other"} 50.0
# HELP vllm:kv_cache_usage_perc KV cache usage (1 = full).
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.25
# HELP vllm:prompt_tokens Prefilled prompt tokens.
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m"} 1000.0
# HELP vllm:generation_tokens Generated tokens.
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{model_name="m"} 5000.0
vllm:generation_tokens_created{model_name="m"} 1.7e9
"""


def test_parse_keeps_the_served_model() -> None:
    counters, gauges = parse_metrics(TEXT, "m")
    assert counters == {"vllm:prompt_tokens_total": 1000.0, "vllm:generation_tokens_total": 5000.0}
    assert gauges["vllm:num_requests_waiting"] == 2.0
    assert parse_metrics(TEXT)[1]["vllm:num_requests_waiting"] == 52.0


@pytest.mark.parametrize(
    "body",
    [
        "",
        "hello world {{",
        "# only a comment\nup 1\n",
        # a pod's NaN or Inf went into rates and the router's scores as if it were a figure
        "vllm:num_requests_waiting NaN\n",
        "vllm:kv_cache_usage_perc +Inf\n",
    ],
)
def test_parse_rejects_what_is_not_runtime_metrics(body: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_metrics(body)


def _sample(pod: str, t: float, gen: float, waiting: float = 0.0) -> PodSample:
    return PodSample(
        pod,
        t,
        {"vllm:generation_tokens_total": gen, "vllm:prompt_tokens_total": gen / 2},
        {"vllm:num_requests_waiting": waiting},
    )


def test_rates_over_windows_and_counter_resets() -> None:
    store = SampleStore(retention_s=120, grace_s=1)
    # pod a: 100 tok/s for 60 s, then 1,000 tok/s for the last 10 s
    store.add(_sample("a", t, 100 * t) for t in range(0, 65, 5))
    store.add([_sample("a", 70, 6000 + 1000 * 5), _sample("a", 75, 6000 + 1000 * 10)])
    panic = store.pod_value("a", "generationTokensPerSecond", now=75, window_s=6)
    assert panic == pytest.approx(1000)
    stable = store.pod_value("a", "generationTokensPerSecond", now=75, window_s=60)
    assert stable == pytest.approx((10_000 + 6000 - 1500) / 60)
    total = store.pod_value("a", "totalTokensPerSecond", now=75, window_s=6)
    assert total == pytest.approx(1500)
    # pod b restarts: 900 -> 50 counts as +50, not -850
    store.add([_sample("b", 60, 800), _sample("b", 65, 900), _sample("b", 70, 50)])
    assert store.pod_value("b", "generationTokensPerSecond", 70, 10) == pytest.approx(150 / 10)


def test_failed_or_thin_data_is_no_data_never_zero() -> None:
    store = SampleStore(retention_s=120)
    store.add([_sample("a", 0, 0, waiting=4), _sample("a", 5, 500, waiting=6)])
    store.add([_sample("b", 0, 0), _sample("b", 5, 500), PodSample("b", 10, error="timeout")])
    store.add([_sample("c", 5, 500)])  # one sample: no rate yet
    assert store.pod_value("a", "requestsWaiting", 5, 6) == 5.0
    assert store.pod_value("b", "generationTokensPerSecond", 10, 60) is None
    assert store.pod_value("c", "generationTokensPerSecond", 5, 60) is None
    assert store.pod_value("c", "requestsWaiting", 5, 60) == 0.0
    reading = store.reading(
        "generationTokensPerSecond",
        1000,
        ready_pods=["a", "b", "c", "d"],
        now=10,
        stable_window_s=60,
        panic_window_s=6,
    )
    assert (reading.stable_total, reading.num_stable_pods) == (pytest.approx(100), 1)
    store.retain(["a"], now=200)
    assert store.pod_names == ["a"] and store.pod_value("a", "requestsWaiting", 200, 60) is None


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/slow":
            time.sleep(1.5)
        status = 500 if self.path == "/broken" else 200
        body = TEXT.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metrics_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.timeout(30)
def test_scrape_pods_concurrently_with_failures_marked(metrics_server: str) -> None:
    targets = [
        PodTarget("ok", f"{metrics_server}/metrics"),
        PodTarget("broken", f"{metrics_server}/broken"),
        PodTarget("slow", f"{metrics_server}/slow"),
        PodTarget("refused", "http://127.0.0.1:9/metrics"),
    ]

    async def go() -> list[PodSample]:
        async with httpx.AsyncClient() as client:
            return await scrape_pods(client, targets, timeout_s=0.5, model_name="m")

    started = time.monotonic()
    ok, broken, slow, refused = asyncio.run(go())
    assert time.monotonic() - started < 1.4, "concurrent, bounded by the timeout"
    assert ok.is_ok and ok.counters["vllm:generation_tokens_total"] == 5000.0
    assert "HTTP 500" in (broken.error or "")
    assert "Timeout" in (slow.error or "")
    assert refused.error and not refused.counters


def _steady(pod: str, rate: float, start: int, end: int) -> list[PodSample]:
    return [_sample(pod, t, rate * (t - start)) for t in range(start, end + 1, 5)]


@pytest.mark.parametrize(
    ("samples", "expected", "num_pods"),
    [
        # two pods at 100 tok/s over the whole window: 200, as the sum of their rates
        (_steady("a", 100, 0, 60) + _steady("b", 100, 0, 60), 200, 2),
        # b became ready at 55 and served 1,000 tok/s for 5 s beside a's 1,000 tok/s: the model
        # served 65,000 tokens in 60 s (1,083/s), not 2,000/s
        (_steady("a", 1000, 0, 60) + _steady("b", 1000, 55, 60), 65_000 / 60, 2),
        # a restarted daemon (samples from 50 on) reads the full rate over what it has
        (_steady("a", 100, 50, 60) + _steady("b", 100, 50, 60), 200, 2),
        # a pod with one sample has no data (not zero): it is not counted
        (_steady("a", 100, 0, 60) + [_sample("b", 60, 0)], 100, 1),
    ],
)
def test_a_counter_total_is_what_the_pods_served_over_the_window(
    samples: list[PodSample], expected: float, num_pods: int
) -> None:
    store = SampleStore(retention_s=120, grace_s=1)
    store.add(samples)
    total, num = store.total(["a", "b"], "generationTokensPerSecond", now=60, window_s=60)
    assert (total, num) == (pytest.approx(expected), num_pods)
