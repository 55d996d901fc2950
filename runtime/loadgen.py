"""A bounded load generator for OpenAI-compatible completion servers (`kubeinfer loadgen`).

`run_load(urls, ...)` sends exactly `num_requests` streamed `/v1/completions` requests, spread
round-robin over the base URLs, and returns a `LoadReport` (throughput, TTFT, inter-token and
end-to-end latency percentiles, errors by kind). It is an importable coroutine: `bench/serve.py`
and the autoscaler's tests reuse it.

- Open loop (`rate` set): Poisson arrivals at `rate` requests/s from a fixed seed; at most
  `concurrency` in flight (an arrival waits for a free slot, so the load stays bounded).
- Closed loop (`rate` None): `concurrency` clients, each sending its next request when the
  previous one ends.
- Prompts are random token ids with lengths drawn uniformly from `prompt_len`; outputs are
  exactly a length drawn from `output_len` (`ignore_eos`, `min_tokens` = `max_tokens`).

`find_pod_urls` finds a model's ready pods by label selector through the Kubernetes API (their
pod IPs on port 8000): clients in the dev cluster cannot use Services. Prompts are never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import typer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadReport:
    """What a load run measured (latencies in seconds; percentiles over successful requests)."""

    num_requests: int
    num_ok: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    tpot_p50_s: float = 0.0
    """Time per output token after the first, per request ((e2e - TTFT) / (tokens - 1)): unlike
    the inter-token gaps, it does not fall when a server sends several tokens' chunks at once."""
    errors: dict[str, int] = field(default_factory=dict)
    requests_per_url: dict[str, int] = field(default_factory=dict)

    @property
    def num_failed(self) -> int:
        return self.num_requests - self.num_ok

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_ok / self.duration_s if self.duration_s > 0 else 0.0

    def summary(self) -> str:
        lines = [
            f"requests: {self.num_ok}/{self.num_requests} ok in {self.duration_s:.2f} s "
            f"({self.requests_per_s:.2f} req/s) over {len(self.requests_per_url)} endpoint(s)",
            f"tokens: {self.prompt_tokens} prompt, {self.output_tokens} output "
            f"({self.output_tokens_per_s:,.1f} output tokens/s)",
            f"TTFT p50 {self.ttft_p50_s * 1e3:.1f} ms, p99 {self.ttft_p99_s * 1e3:.1f} ms",
            f"inter-token p50 {self.itl_p50_s * 1e3:.2f} ms, p99 {self.itl_p99_s * 1e3:.2f} ms, "
            f"time per output token p50 {self.tpot_p50_s * 1e3:.2f} ms",
            f"end-to-end p50 {self.e2e_p50_s:.3f} s, p99 {self.e2e_p99_s:.3f} s",
        ]
        lines += [f"error {kind}: {n}" for kind, n in sorted(self.errors.items())]
        return "\n".join(lines)


@dataclass(slots=True)
class _Result:
    url: str
    ok: bool
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


class LoadgenError(RuntimeError):
    """Nothing to send load to (no URLs, no ready pods, no model)."""


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


async def _one_request(
    client: httpx.AsyncClient, url: str, body: dict[str, object], timeout: float
) -> _Result:
    started = time.perf_counter()
    result = _Result(url, ok=False)
    last = None
    try:
        async with client.stream(
            "POST", f"{url}/v1/completions", json=body, timeout=timeout
        ) as resp:
            if resp.status_code != 200:
                await resp.aread()
                result.error = f"HTTP {resp.status_code}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = f"stream error {event['error'].get('code', '')}".strip()
                    return result
                now = time.perf_counter()
                if event.get("choices"):
                    if last is None:
                        result.ttft_s = now - started
                    else:
                        result.gaps_s.append(now - last)
                    last = now
                if usage := event.get("usage"):
                    result.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    result.output_tokens = int(usage.get("completion_tokens", 0))
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
        return result
    result.e2e_s = time.perf_counter() - started
    result.ok = last is not None
    result.error = "" if result.ok else "empty stream"
    return result


async def _model_name(client: httpx.AsyncClient, url: str, timeout: float) -> str:
    resp = await client.get(f"{url}/v1/models", timeout=timeout)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise LoadgenError(f"{url}/v1/models lists no model")
    return str(data[0]["id"])


async def run_load(
    urls: list[str],
    *,
    num_requests: int,
    rate: float | None = None,
    concurrency: int = 16,
    seed: int = 0,
    prompt_len: tuple[int, int] = (16, 128),
    output_len: tuple[int, int] = (16, 128),
    model: str | None = None,
    api_key: str | None = None,
    timeout: float = 120.0,
    token_id_range: tuple[int, int] = (100, 5000),
) -> LoadReport:
    """Send `num_requests` streamed completions over `urls`; see the module docstring."""
    if not urls:
        raise LoadgenError("no URLs to send load to")
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, limits=limits) as client:
        model = model or await _model_name(client, urls[0], timeout)
        bodies = []
        for _ in range(num_requests):
            n_out = rng.randint(*output_len)
            prompt = [rng.randrange(*token_id_range) for _ in range(rng.randint(*prompt_len))]
            bodies.append(
                {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": n_out,
                    "min_tokens": n_out,
                    "ignore_eos": True,
                    "temperature": 0.0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            )
        slots = asyncio.Semaphore(concurrency)
        started = time.perf_counter()

        async def send(i: int, at: float) -> _Result:
            if at > 0:
                await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
            async with slots:
                return await _one_request(client, urls[i % len(urls)], bodies[i], timeout)

        offsets, t = [], 0.0
        for _ in range(num_requests):
            offsets.append(t)
            if rate:
                t += rng.expovariate(rate)
        results = await asyncio.gather(*(send(i, at) for i, at in enumerate(offsets)))
        duration = time.perf_counter() - started
    return _report(results, num_requests, duration)


def _report(results: list[_Result], num_requests: int, duration: float) -> LoadReport:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    per_url: dict[str, int] = {}
    for r in results:
        per_url[r.url] = per_url.get(r.url, 0) + 1
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    ttft = [r.ttft_s for r in ok]
    gaps = [g for r in ok for g in r.gaps_s]
    e2e = [r.e2e_s for r in ok]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return LoadReport(
        num_requests=num_requests,
        num_ok=len(ok),
        duration_s=duration,
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        output_tokens=sum(r.output_tokens for r in ok),
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        itl_p50_s=percentile(gaps, 50),
        itl_p99_s=percentile(gaps, 99),
        tpot_p50_s=percentile(tpot, 50),
        e2e_p50_s=percentile(e2e, 50),
        e2e_p99_s=percentile(e2e, 99),
        errors=errors,
        requests_per_url=per_url,
    )


def find_pod_urls(
    selector: str, namespace: str, *, kubeconfig: Path | None = None, port: int = 8000
) -> list[str]:
    """Base URLs (http://POD_IP:port) of the ready, not terminating pods matching `selector`."""
    from kubernetes import client, config

    if kubeconfig is not None:
        api = config.new_client_from_config(config_file=str(kubeconfig))
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.ApiClient()
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector).items
    urls = []
    for pod in sorted(pods, key=lambda p: p.metadata.name or ""):
        status = pod.status
        if pod.metadata.deletion_timestamp is not None or status is None or not status.pod_ip:
            continue
        if any(c.type == "Ready" and c.status == "True" for c in status.conditions or []):
            urls.append(f"http://{status.pod_ip}:{port}")
    return urls


def _span(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    lo, hi = int(low), int(high or low)
    if not 1 <= lo <= hi:
        raise ValueError(f"{text!r}: want MIN:MAX with 1 <= MIN <= MAX")
    return lo, hi


def loadgen(
    url: list[str] = typer.Option([], "--url", help="Base URL (repeatable), e.g. http://h:8000"),
    selector: str | None = typer.Option(None, help="Find ready pods by this label selector."),
    namespace: str = typer.Option("default", help="Namespace of the pods (with --selector)."),
    kubeconfig: Path | None = typer.Option(None, help="Kubeconfig (default: in-cluster/~)."),
    port: int = typer.Option(8000, help="The pods' port (with --selector)."),
    num_requests: int = typer.Option(100, min=1, help="Requests to send in all."),
    rate: float | None = typer.Option(
        None, min=0.001, help="Poisson req/s (default: closed loop)."
    ),
    concurrency: int = typer.Option(16, min=1, help="Most requests in flight."),
    seed: int = typer.Option(0, help="Seed of arrivals and lengths."),
    prompt_len: str = typer.Option("16:128", help="Prompt tokens, MIN:MAX."),
    output_len: str = typer.Option("16:128", help="Output tokens, MIN:MAX (exact)."),
    model: str | None = typer.Option(None, help="Model name (default: the first in /v1/models)."),
    api_key: str | None = typer.Option(
        None, help="Bearer token.", envvar="KUBEINFER_API_KEY", show_envvar=False
    ),
    timeout: float = typer.Option(120.0, help="Per-request timeout, seconds."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Send a bounded load of streamed completions; report throughput, TTFT, inter-token p50/p99."""
    logging.basicConfig(level=logging.WARNING)
    try:
        urls = list(url)
        if selector:
            urls += find_pod_urls(selector, namespace, kubeconfig=kubeconfig, port=port)
        if not urls:
            raise LoadgenError("no endpoints: give --url or a --selector that matches ready pods")
        report = asyncio.run(
            run_load(
                urls,
                num_requests=num_requests,
                rate=rate,
                concurrency=concurrency,
                seed=seed,
                prompt_len=_span(prompt_len),
                output_len=_span(output_len),
                model=model,
                api_key=api_key,
                timeout=timeout,
            )
        )
    except (LoadgenError, ValueError, httpx.HTTPError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        from dataclasses import asdict

        typer.echo(
            json.dumps({**asdict(report), "output_tokens_per_s": report.output_tokens_per_s})
        )
    else:
        typer.echo(report.summary())
    if report.num_ok < report.num_requests:
        raise typer.Exit(1)
