"""Prometheus `/metrics` with vLLM's metric names, labelled `model_name`.

Counters and gauges are read from the engine at scrape time (one source of truth: the
engine's own counters); latency histograms are observed as requests finish.

`vllm:cache_config_info` is vLLM's info gauge (always 1) whose labels describe the KV cache
(`block_size`, `num_gpu_blocks`, ...); routers and the Gateway API Inference Extension's
endpoint picker read the KV capacity from it. Like vLLM, it appears once the engine is up, and
`num_gpu_blocks` is the pool's size on any device (vLLM's CPU backend reports it the same way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kubeinfer.runtime.engine.engine import Engine
from kubeinfer.runtime.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_TOKEN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("queue_requests", "queue_tokens")


class _EngineCollector(Collector):
    def __init__(self, model_name: str, engine: Callable[[], Engine | None]) -> None:
        self.model_name, self.engine = model_name, engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine()
        name = [self.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(name, value)
            return c

        running = len(engine.scheduler.running) if engine else 0
        waiting = engine.scheduler.num_waiting if engine else 0
        usage = engine.kv_cache.usage if engine else 0.0
        stats = engine.stats if engine else None
        prefix = engine.kv_cache.prefix_stats if engine else None
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", usage)
        yield gauge("vllm:gpu_cache_usage_perc", "Deprecated: vllm:kv_cache_usage_perc.", usage)
        yield counter(
            "vllm:prompt_tokens",
            "Prefilled prompt tokens.",
            stats.num_prompt_tokens if stats else 0,
        )
        yield counter(
            "vllm:generation_tokens",
            "Generated tokens.",
            stats.num_generation_tokens if stats else 0,
        )
        yield counter(
            "vllm:num_preemptions",
            "Preempted requests.",
            engine.scheduler.num_preemptions if engine else 0,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            prefix.num_queried_tokens if prefix else 0,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            prefix.num_hit_tokens if prefix else 0,
        )
        if engine is not None:
            yield _cache_config_info(engine)
        success = CounterMetricFamily(
            "vllm:request_success", "Finished requests.", labels=["model_name", "finished_reason"]
        )
        for reason in FINISH_REASONS:
            count = stats.num_requests_finished.get(reason, 0) if stats else 0
            success.add_metric([self.model_name, reason], count)
        yield success


def _cache_config_info(engine: Engine) -> GaugeMetricFamily:
    """vLLM's `CacheConfig.metrics_info()` labels that mean something here, as vLLM writes
    them (`str()` of each value: "True", "None"); the KV dtype follows the model's ("auto")."""
    kv = engine.kv_cache
    labels = {
        "block_size": str(kv.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(kv.enable_prefix_caching),
        "gpu_memory_utilization": str(engine.config.kv_cache_memory_fraction),
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(kv.num_blocks),
        "engine": "0",
    }
    info = GaugeMetricFamily(
        "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(labels)
    )
    info.add_metric(list(labels.values()), 1.0)
    return info


class RuntimeMetrics:
    def __init__(self, model_name: str, engine: Callable[[], Engine | None]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.inter_token = histogram(
            "vllm:inter_token_latency_seconds", "Time between generated tokens.", _TOKEN_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Request latency, end to end.", _LATENCY_BUCKETS
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Time waiting before the first step.",
            _LATENCY_BUCKETS,
        )
        self.rejected = Counter(
            "kubeinfer:requests_rejected",
            "Requests refused with 429 because the waiting queue was full, by bound.",
            ["model_name", "reason"],
            registry=self.registry,
        )
        for reason in REJECT_REASONS:  # exported at 0 from the start, so rates work
            self.rejected.labels(model_name, reason)
        self.registry.register(_EngineCollector(model_name, engine))

    def observe_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is None:
            return
        name = self.model_name
        if m.time_to_first_token is not None:
            self.ttft.labels(name).observe(m.time_to_first_token)
        if m.e2e_latency is not None:
            self.e2e.labels(name).observe(m.e2e_latency)
        if m.queue_time is not None:
            self.queue.labels(name).observe(m.queue_time)
        inter = self.inter_token.labels(name)
        for seconds in m.inter_token_latencies:
            inter.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
