"""The router against round robin on the dev cluster: 3 SmolLM2 replicas, long shared prefixes.

One model (`routing.mode: router`) on the dev cluster; the script measures, in one run:

- the cold start: the model at 0 replicas (minReplicas 0), one streamed request through its
  router pod; the time to its first token covers the router holding it, the autoscaler's
  0 -> 1, the pod's start and the prefill;
- then at 3 replicas the same seeded workload twice: (a) through the router pod, (b) round
  robin over the 3 runtime pods (one request each in turn, as a Service spreads connections).
  A handful of long system prompts (several hundred tokens; more than one pod's KV pool holds)
  each followed by a short question, closed loop at a fixed concurrency, streamed completions
  with a fixed output length. Each
  run gets prompts of its own (same lengths and order, different text), so neither inherits
  the other's prefix cache.

Prints TTFT p50/p99, output tok/s and the prefix-cache hit rate (the pods' own
vllm:prefix_cache_hits_total over queries) of both, and the ratios (goal: TTFT p50 at most
half of round robin's, throughput at least 1.3x); appends a row to RESULTS.md.

    .venv/bin/python bench/router.py [--num-requests 96] [--concurrency 8]

Uses the running dev cluster (`kubeinfer dev up`), or brings one up and down itself. Only
127.x pod IPs are ever connected to.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from kubeinfer.devcluster.cluster import DevCluster
from kubeinfer.devcluster.testing import DevClusterHandle, _is_running, _make_handle, wait_for
from kubeinfer.operator.manifests import (
    GROUP,
    PLURAL,
    VERSION,
    router_selector_string,
    selector_string,
)
from kubeinfer.operator.testing import OperatorProcess
from kubeinfer.runtime.loadgen import percentile

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "crds" / "inferencemodels.kubeinfer.dev.yaml"
MODEL_DIR = REPO / ".cache" / "models" / "smollm2-135m"
RESULTS = Path(__file__).with_name("RESULTS.md")
NAME = "bench-router"
NUM_REPLICAS = 3
#: More prefixes than one pod's KV pool holds (NUM_KV_BLOCKS x 16 tokens, less the running
#: requests' blocks: about half of them here), fewer than the three pools hold between them:
#: what a prefix-aware router is for. With every prefix cached on every pod (8 prefixes over
#: 256 blocks, 2026-12-05) round robin hit 60 % to the router's 66 %, and the router won 1.23x.
NUM_PREFIXES = 12
NUM_KV_BLOCKS = 160  # of 16 tokens; a ~400-token prefix takes 25
PREFIX_WORDS = 300  # about 400 tokens of SmolLM2's tokenizer
OUTPUT_TOKENS = 16
READY_TIMEOUT_S = 600
WORDS = (
    "shipment parcel customs invoice carrier warehouse pallet route depot tracking label "
    "freight courier delivery address signature refund claim damage weight volume port "
    "container manifest schedule delay priority express standard insurance policy window"
).split()


@dataclass(slots=True)
class RunStats:
    ttfts_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_failed: int = 0
    duration_s: float = 0.0
    cache_hit_rate: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.duration_s if self.duration_s else 0.0


def workload(seed: int, label: str, num_requests: int) -> list[str]:
    """Prompts: one of NUM_PREFIXES long system prompts (`label` makes them this run's own)
    and a short question; the choice of prefix and question is the seed's, the same per run."""
    rng = random.Random(seed)
    prefixes = [
        f"[{label} system {k}] You are the assistant of a logistics company. "
        + " ".join(rng.choice(WORDS) for _ in range(PREFIX_WORDS))
        for k in range(NUM_PREFIXES)
    ]
    return [
        f"{rng.choice(prefixes)}\nQuestion {i}: where is parcel {rng.randrange(10_000)}?\n"
        for i in range(num_requests)
    ]


async def one_request(
    http: httpx.AsyncClient, url: str, prompt: str, stats: RunStats
) -> None:
    body = {
        "model": "smollm2", "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
        "min_tokens": OUTPUT_TOKENS, "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    first: float | None = None
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                stats.num_failed += 1
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("choices") and first is None:
                    first = time.perf_counter()
                if usage := event.get("usage"):
                    stats.num_output_tokens += int(usage.get("completion_tokens", 0))
    except httpx.HTTPError:
        stats.num_failed += 1
        return
    if first is None:
        stats.num_failed += 1
    else:
        stats.ttfts_s.append(first - started)


async def run(urls: list[str], prompts: list[str], concurrency: int) -> RunStats:
    """Closed loop: request i goes to urls[i % len(urls)] (one URL: the router)."""
    stats = RunStats()
    slots = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=READY_TIMEOUT_S) as http:

        async def send(i: int, prompt: str) -> None:
            async with slots:
                await one_request(http, urls[i % len(urls)], prompt, stats)

        started = time.perf_counter()
        await asyncio.gather(*(send(i, p) for i, p in enumerate(prompts)))
        stats.duration_s = time.perf_counter() - started
    return stats


def prefix_cache_counts(pod_urls: list[str]) -> tuple[float, float]:
    """(hits, queries) of the pods' prefix caches, summed."""
    hits = queries = 0.0
    for url in pod_urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "vllm:prefix_cache_hits_total":
                    hits += s.value
                elif s.name == "vllm:prefix_cache_queries_total":
                    queries += s.value
    return hits, queries


def router_decisions(router_url: str) -> dict[str, float]:
    """kubeinfer_router_decisions_total by reason, from the router pod's /metrics."""
    text = httpx.get(f"{router_url}/metrics", timeout=10).text
    return {
        s.labels.get("reason", "?"): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kubeinfer_router_decisions_total"
    }


def measured(urls: list[str], pod_urls: list[str], prompts: list[str], conc: int) -> RunStats:
    hits0, queries0 = prefix_cache_counts(pod_urls)
    stats = asyncio.run(run(urls, prompts, conc))
    hits1, queries1 = prefix_cache_counts(pod_urls)
    stats.cache_hit_rate = (hits1 - hits0) / max(queries1 - queries0, 1.0)
    return stats


def ready_ips(dev: DevClusterHandle, ns: str, selector: str) -> list[str]:
    pods = dev.core.list_namespaced_pod(ns, label_selector=selector).items
    return sorted(
        p.status.pod_ip
        for p in pods
        if p.metadata.deletion_timestamp is None
        and p.status.pod_ip
        and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
    )


def model_body(ns: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceModel",
        "metadata": {"name": NAME, "namespace": ns},
        "spec": {
            "model": {"uri": f"hostpath://{MODEL_DIR.resolve()}", "servedName": "smollm2"},
            "runtime": {"dtype": "float32", "maxModelLen": 2048, "maxNumSeqs": 16,
                        "maxNumBatchedTokens": 2048,
                        "extraArgs": ["--device", "cpu", "--num-kv-blocks", str(NUM_KV_BLOCKS)]},
            "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
            "replicas": 0,
            "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 1,
                            "scrapeIntervalSeconds": 1, "panicWindowSeconds": 2,
                            "stableWindowSeconds": 10},
        },
    }  # fmt: skip


def cold_start(dev: DevClusterHandle, ns: str) -> tuple[float, str]:
    """TTFT of one request at 0 replicas through the router pod; the router's URL."""
    router = router_selector_string(NAME)
    ips = wait_for(lambda: ready_ips(dev, ns, router), timeout_s=120, what="a Ready router")
    router_url = f"http://{ips[0]}:8000"
    assert router_url.startswith("http://127."), router_url
    stats = asyncio.run(run([router_url], ["Hello, who are you?"], 1))
    if not stats.ttfts_s:
        raise RuntimeError("the cold-start request failed")
    return stats.ttfts_s[0], router_url


def bench(dev: DevClusterHandle, args: argparse.Namespace, log_dir: Path) -> None:
    dev.kubectl("apply", "-f", str(CRD))
    dev.kubectl("wait", "--for=condition=established", "crd/inferencemodels.kubeinfer.dev")
    custom = client.CustomObjectsApi(dev.api_client)
    ns = dev.namespace("bench-router")
    op = OperatorProcess.start(dev.kubeconfig, [ns], log_dir / "operator.log")
    try:
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, model_body(ns))
        cold_s, router_url = cold_start(dev, ns)
        print(f"cold start (0 replicas -> first token through the router): {cold_s:.1f} s")
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, NAME,
            {"spec": {"autoscaling": {"enabled": False}, "replicas": NUM_REPLICAS}},
            _content_type="application/merge-patch+json",
        )  # fmt: skip
        pod_ips = wait_for(
            lambda: (ips := ready_ips(dev, ns, selector_string(NAME))) and
            len(ips) == NUM_REPLICAS and ips, timeout_s=READY_TIMEOUT_S, what="3 Ready pods",
        )  # fmt: skip
        pod_urls = [f"http://{ip}:8000" for ip in pod_ips]
        time.sleep(4)  # the router lists pods every 2 s
        asyncio.run(run(pod_urls, ["Warm up."] * NUM_REPLICAS, NUM_REPLICAS))
        n, conc = args.num_requests, args.concurrency
        before = router_decisions(router_url)
        routed = measured([router_url], pod_urls, workload(args.seed, "a", n), conc)
        after = router_decisions(router_url)
        print("router decisions: " + ", ".join(
            f"{reason} {after[reason] - before.get(reason, 0):.0f}" for reason in sorted(after)
        ))  # fmt: skip
        rr = measured(pod_urls, pod_urls, workload(args.seed, "b", n), conc)
    finally:
        op.stop()
        dev.delete_namespace(ns)
    report(routed, rr, cold_s, args, record=not args.no_record)


def _describe(s: RunStats) -> str:
    return (
        f"TTFT p50 {percentile(s.ttfts_s, 50) * 1000:.0f} ms p99 "
        f"{percentile(s.ttfts_s, 99) * 1000:.0f} ms, {s.tokens_per_s:.1f} out tok/s, "
        f"prefix hits {s.cache_hit_rate:.0%}, failed {s.num_failed}"
    )


def report(
    routed: RunStats, rr: RunStats, cold_s: float, args: argparse.Namespace, *, record: bool
) -> None:
    ttft_ratio = percentile(routed.ttfts_s, 50) / max(percentile(rr.ttfts_s, 50), 1e-9)
    tput_ratio = routed.tokens_per_s / max(rr.tokens_per_s, 1e-9)
    goal = ttft_ratio <= 0.5 and tput_ratio >= 1.3
    print(f"router:      {_describe(routed)}")
    print(f"round robin: {_describe(rr)}")
    print(f"TTFT p50 ratio {ttft_ratio:.2f} (goal <= 0.5), throughput ratio {tput_ratio:.2f} "
          f"(goal >= 1.3): {'met' if goal else 'missed'}")  # fmt: skip
    row = (
        f"| {dt.date.today().isoformat()} | router | SmolLM2 fp32 CPU, {NUM_REPLICAS} replicas, "
        f"dev cluster, {NUM_KV_BLOCKS} KV blocks each, {args.num_requests} req over "
        f"{NUM_PREFIXES} ~400-token prefixes, "
        f"concurrency {args.concurrency}, {OUTPUT_TOKENS} out | {_describe(routed)}; cold start "
        f"{cold_s:.1f} s | round robin {_describe(rr)} | TTFT p50 ratio {ttft_ratio:.2f}, "
        f"throughput ratio {tput_ratio:.2f} "
        f"(goal <= 0.5, >= 1.3: {'met' if goal else 'missed'}) |\n"
    )
    if record:
        with open(RESULTS, "a") as f:
            f.write(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args()
    if not 1 <= args.num_requests <= 1000 or not 1 <= args.concurrency <= 64:
        parser.error("--num-requests 1..1000, --concurrency 1..64")
    cluster = DevCluster.from_env()
    reused = cluster.layout.state_file.exists() and _is_running(cluster)
    if not reused:
        cluster.up()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bench(_make_handle(cluster), args, Path(tmp))
    finally:
        if not reused:
            cluster.down()


if __name__ == "__main__":
    main()
