"""The autoscaler on the dev cluster, end to end, with real runtime pods under real load.

One operator subprocess watches one fresh namespace with one autoscaled model: a random
2-layer Llama with SmolLM2's tokenizer (fast to load and to run on 2 CPU cores), short windows
and a low tokens/s target, so a bounded closed-loop load from `kubeinfer.runtime.loadgen` (which
finds the ready pods by selector and talks to their 127.x pod IPs, never to a Service) asks for
more replicas than maxReplicas allows. One story, checked as it happens:

1. load -> spec.replicas 1 -> 2 within 3 scrape intervals after the stable window fills; the
   status (desiredReplicas, metrics, lastScaleTime, scalingHistory, ScalingActive and
   ScalingLimited), the printer column Tokens/s and a "scaled 1 -> 2: ..." event say so;
2. every pod's /metrics made to fail (the runtime's `--metrics-fault-file` hook) while the
   load goes on -> no scale-down for longer than the delay, ScalingActive False;
3. scrapes back, load stopped -> 2 -> 1, not before scaleDownDelaySeconds and within a bound.

A sampler thread records the replicas every 0.25 s; the timeline is printed (`-s`) and is part
of every failure message. Every wait and the load are bounded in time and request count.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client, config

from kubeinfer.devcluster.testing import DevClusterHandle, wait_for
from kubeinfer.operator.testing import OperatorProcess
from kubeinfer.runtime.loadgen import LoadReport, find_pod_urls, run_load
from kubeinfer.runtime.testing import llama_config, write_random_checkpoint
from tests.operator.conftest import CRD_PATH

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(420)]

GROUP, VERSION, PLURAL = "kubeinfer.dev", "v1alpha1", "inferencemodels"
NAME = "scaler"
SCRAPE_S = 2
PANIC_S = 4
STABLE_S = 6
DOWN_DELAY_S = 10
TARGET = 3  # generation tokens/s per replica: even a starved pod streams far more
MAX_REPLICAS = 2
READY_TIMEOUT_S = 120
MAX_LOAD_REQUESTS = 2000  # the load's hard bound; it normally stops far earlier
LOAD_CONCURRENCY = 4
SLACK_S = 4  # API round trips and pod-status lag on a shared 2-core machine


def model_body(model_dir: Path, fault_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceModel",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": f"hostpath://{model_dir}", "servedName": "tiny"},
            "runtime": {
                "dtype": "float32",
                "maxModelLen": 512,
                "maxNumSeqs": 16,
                "maxNumBatchedTokens": 512,
                "extraArgs": ["--device", "cpu", "--num-kv-blocks", "256"],
                # the test hook: /metrics answers 503 while FAULT_DIR/POD_NAME exists
                "env": [
                    {"name": "KUBEINFER_METRICS_FAULT_FILE", "value": f"{fault_dir}/$(POD_NAME)"},
                    # no C++ attention build per pod (its /tmp is the pod's own): on a busy
                    # 2-core machine a new replica compiled for minutes before it was ready
                    {"name": "KUBEINFER_CPU_KERNELS", "value": "0"},
                ],
            },
            "resources": {"gpus": 0, "cpu": "100m", "memory": "1Gi"},
            "autoscaling": {
                "enabled": True,
                "minReplicas": 1,
                "maxReplicas": MAX_REPLICAS,
                "metric": "generationTokensPerSecond",
                "targetPerReplica": TARGET,
                "stableWindowSeconds": STABLE_S,
                "panicWindowSeconds": PANIC_S,
                "scaleDownDelaySeconds": DOWN_DELAY_S,
                "scrapeIntervalSeconds": SCRAPE_S,
            },
        },
    }


@dataclass
class Sample:
    t: float  # seconds since the sampler started
    replicas: int | None
    ready: int | None
    tokens_per_s: float | None
    scaling_active: str | None


@dataclass
class Sampler:
    """Polls the model every 0.25 s on its own API client (a thread beside the test)."""

    kubeconfig: Path
    ns: str
    samples: list[Sample] = field(default_factory=list)
    start: float = field(default_factory=time.monotonic)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        api = config.new_client_from_config(config_file=str(self.kubeconfig))
        self.custom = client.CustomObjectsApi(api)
        self.thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                m = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, NAME)
            except Exception:  # noqa: BLE001 - a missed sample is fine, the next one comes
                continue
            status = m.get("status") or {}
            active = _condition(status, "ScalingActive").get("status")
            self.samples.append(
                Sample(
                    round(time.monotonic() - self.start, 2),
                    m["spec"].get("replicas"),
                    status.get("readyReplicas"),
                    (status.get("metrics") or {}).get("generationTokensPerSecond"),
                    active,
                )
            )

    def now(self) -> float:
        return time.monotonic() - self.start

    def since(self, t: float) -> list[Sample]:
        return [s for s in self.samples if s.t >= t]

    def first(self, replicas: Callable[[int], bool], after: float, timeout_s: float) -> float:
        """When (sampler time) spec.replicas first satisfied `replicas` after `after`."""

        def seen() -> float | None:
            return next((s.t for s in self.since(after) if replicas(s.replicas or 0)), None)

        return wait_for(seen, timeout_s=timeout_s, what="a matching replica sample")

    def timeline(self) -> str:
        """Only the samples where something changed: t replicas/ready tokens/s ScalingActive."""
        lines, last = [], None
        for s in self.samples:
            key = (s.replicas, s.ready, s.scaling_active)
            if key != last:
                lines.append(
                    f"t={s.t:6.2f}s replicas={s.replicas} ready={s.ready} "
                    f"tokens/s={s.tokens_per_s} ScalingActive={s.scaling_active}"
                )
                last = key
        return "\n".join(lines)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)


@dataclass
class Load:
    """Closed-loop load in bounded batches until stopped; each batch re-finds the ready pods,
    so new replicas get their share. At most MAX_LOAD_REQUESTS requests in all."""

    selector: str
    ns: str
    kubeconfig: Path
    reports: list[LoadReport] = field(default_factory=list)
    num_sent: int = 0
    first_batch_at: float | None = None
    error: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="load", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.num_sent < MAX_LOAD_REQUESTS:
                urls = find_pod_urls(self.selector, self.ns, kubeconfig=self.kubeconfig)
                if not urls:
                    time.sleep(0.25)
                    continue
                n = 4 * LOAD_CONCURRENCY  # batches long enough that their tails barely dip
                self.first_batch_at = self.first_batch_at or time.monotonic()
                report = asyncio.run(
                    run_load(
                        urls,
                        num_requests=n,
                        concurrency=LOAD_CONCURRENCY,
                        seed=len(self.reports),
                        prompt_len=(8, 32),
                        output_len=(24, 48),
                        timeout=30,
                    )
                )
                self.num_sent += n
                self.reports.append(report)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    @property
    def is_running(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(60)


class Env:
    """The dev cluster, the namespace, the operator and the model's paths."""

    def __init__(self, dev: DevClusterHandle, ns: str, root: Path, log_dir: Path) -> None:
        self.dev, self.ns, self.root, self.log_dir = dev, ns, root, log_dir
        self.custom = client.CustomObjectsApi(dev.api_client)
        self.fault_dir = root / "faults"
        self.fault_dir.mkdir()
        self.operator: OperatorProcess | None = None

    def model(self) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, NAME)

    def status(self) -> dict[str, Any]:
        return self.model().get("status") or {}

    def replicas(self) -> int:
        return int(self.model()["spec"]["replicas"])

    def ready_pods(self) -> list[tuple[str, str]]:
        """(name, pod IP) of the ready, not terminating pods."""
        pods = self.dev.core.list_namespaced_pod(
            self.ns,  # the runtime's pods, not the router's
            label_selector=f"app.kubernetes.io/name=kubeinfer-runtime,app.kubernetes.io/instance={NAME}",
        ).items
        return [
            (p.metadata.name, p.status.pod_ip)
            for p in pods
            if p.metadata.deletion_timestamp is None
            and p.status.pod_ip
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        ]

    def scale_events(self) -> list[str]:
        events = self.dev.core.list_namespaced_event(self.ns).items
        return [
            e.message
            for e in sorted(events, key=lambda e: e.metadata.creation_timestamp)
            if e.involved_object.kind == "InferenceModel" and e.reason == "Scaled"
        ]

    def diagnostics(self, sampler: Sampler | None = None) -> str:
        parts = [f"--- status ---\n{json.dumps(self.status(), indent=1)}"]
        if sampler is not None:
            parts.append(f"--- replica timeline ---\n{sampler.timeline()}")
        if self.operator is not None:
            parts.append(f"--- operator log ---\n{self.operator.tail(3000)}")
        return "\n".join(parts)


@pytest.fixture(scope="module")
def env(dev_cluster: DevClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    dev_cluster.kubectl("apply", "-f", str(CRD_PATH))
    dev_cluster.kubectl(
        "wait", "--for=condition=established", "crd/inferencemodels.kubeinfer.dev", "--timeout=60s"
    )
    # Under kubeinfer's cache, never /tmp (see test_operator_cluster.weights_dir).
    cache = Path(os.environ.get("KUBEINFER_CACHE", Path.home() / ".cache" / "kubeinfer"))
    root = cache / "operator-tests" / f"a{time.time_ns()}"
    root.mkdir(parents=True)
    ns = dev_cluster.namespace("as")
    e = Env(dev_cluster, ns, root, tmp_path_factory.mktemp("autoscale"))
    e.operator = OperatorProcess.start(dev_cluster.kubeconfig, [ns], e.log_dir / "operator.log")
    try:
        yield e
    finally:
        dev_cluster.kubectl("delete", "inferencemodels", "--all", "-n", ns, "--wait=false",
                            check=False)  # fmt: skip
        e.operator.stop()
        dev_cluster.delete_namespace(ns)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_model(env: Env, smollm2_dir: Path) -> Path:
    """A random 2-layer Llama with SmolLM2's vocabulary and tokenizer (loads in a second)."""
    config_ = llama_config(vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=512)
    out = write_random_checkpoint(env.root / "tiny", config_)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out / name)
    return out


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def _tokens_column(env: Env) -> str:
    out = env.dev.kubectl("get", "im", NAME, "-n", env.ns)
    header, row = out.strip().splitlines()
    assert header.split()[4] == "TOKENS/S", header
    return row.split()[4]


def _metrics_status(ip: str) -> int:
    return httpx.get(f"http://{ip}:8000/metrics", timeout=5).status_code


def test_load_scales_up_failed_scrapes_hold_idle_scales_down(env: Env, tiny_model: Path) -> None:
    body = model_body(tiny_model, env.fault_dir)
    env.custom.create_namespaced_custom_object(GROUP, VERSION, env.ns, PLURAL, body)
    sampler = Sampler(env.dev.kubeconfig, env.ns)
    load: Load | None = None
    try:
        wait_for(
            lambda: env.status().get("phase") == "Ready" and len(env.ready_pods()) == 1,
            timeout_s=READY_TIMEOUT_S,
            what="one ready replica",
        )
        assert env.replicas() == 1
        selector = env.status()["selector"]
        time.sleep(STABLE_S)  # idle windows: nothing scales without load
        assert env.replicas() == 1, env.diagnostics(sampler)

        # 1. load -> 1 -> 2 within 3 scrape intervals after the stable window fills
        load = Load(selector, env.ns, env.dev.kubeconfig)
        load.start()
        wait_for(lambda: load.first_batch_at, timeout_s=30, what="the load's first batch")
        assert load.first_batch_at is not None
        load_t0 = load.first_batch_at - sampler.start
        bound_s = STABLE_S + 3 * SCRAPE_S
        try:
            up_at = sampler.first(lambda n: n >= 2, load_t0, timeout_s=bound_s + 5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{env.diagnostics(sampler)}") from None
        assert up_at - load_t0 <= bound_s, env.diagnostics(sampler)

        status = env.status()
        assert status["desiredReplicas"] == 2
        assert status["lastScaleTime"].endswith("Z")
        last = status["scalingHistory"][-1]
        assert (last["from"], last["to"]) == (1, 2) and "generation tokens/s" in last["reason"]
        active = _condition(status, "ScalingActive")
        assert (active["status"], active["reason"]) == ("True", "ValidMetricFound"), status

        def limited() -> dict[str, Any] | None:
            c = _condition(env.status(), "ScalingLimited")
            return c if c.get("status") == "True" else None

        c = wait_for(limited, timeout_s=3 * SCRAPE_S, what="ScalingLimited True")
        assert c["reason"] == "TooManyReplicas" and f"maxReplicas {MAX_REPLICAS}" in c["message"]
        metrics = env.status()["metrics"]
        assert metrics["generationTokensPerSecond"] > 0, metrics
        assert {"totalTokensPerSecond", "requestsRunning", "kvCacheUsage"} <= set(metrics)
        assert float(_tokens_column(env)) > 0  # kubectl get im shows tokens/s
        (up_event,) = wait_for(env.scale_events, timeout_s=10, what="a Scaled event")
        assert re.fullmatch(
            rf"scaled 1 -> 2: (panic: )?generation tokens/s [\d,.]+ over target {TARGET} "
            rf"per replica( \(.*\))?",
            up_event,
        ), up_event

        # 2. every pod's /metrics fails while loaded -> no scale-down
        wait_for(lambda: len(env.ready_pods()) == 2, timeout_s=READY_TIMEOUT_S,
                 what="two ready replicas")  # fmt: skip
        wait_for(lambda: env.status().get("readyReplicas") == 2, timeout_s=10,
                 what="status.readyReplicas 2")  # fmt: skip
        time.sleep(2 * SCRAPE_S)  # the load reaches the new pod (the next batch finds it)
        pods = env.ready_pods()
        for pod_name, _ in pods:
            (env.fault_dir / pod_name).touch()
        assert all(_metrics_status(ip) == 503 for _, ip in pods)
        blocked_t0 = sampler.now()

        def inactive() -> dict[str, Any] | None:
            c = _condition(env.status(), "ScalingActive")
            return c if c.get("status") == "False" else None

        c = wait_for(inactive, timeout_s=3 * SCRAPE_S + SLACK_S, what="ScalingActive False")
        assert c["reason"] == "FailedGetMetrics", c
        time.sleep(max(0.0, DOWN_DELAY_S + STABLE_S + 2 * SCRAPE_S - (sampler.now() - blocked_t0)))
        assert load.is_running and load.error is None, load.error  # loaded the whole time
        held = sampler.since(blocked_t0)
        assert held and all(s.replicas == 2 for s in held), env.diagnostics(sampler)
        for pod_name, _ in pods:
            (env.fault_dir / pod_name).unlink()
        assert all(_metrics_status(ip) == 200 for _, ip in pods)
        wait_for(lambda: _condition(env.status(), "ScalingActive").get("status") == "True",
                 timeout_s=3 * SCRAPE_S + SLACK_S, what="ScalingActive True again")  # fmt: skip

        # 3. load stops -> back to 1, after the scale-down delay and within a bound
        load.stop()
        assert not load.is_running and load.error is None, load.error
        stop_t = sampler.now()
        # windows drain (stable), panic mode ends (a stable window after its last ask), the delay
        down_bound_s = 2 * STABLE_S + DOWN_DELAY_S + 3 * SCRAPE_S + SLACK_S
        try:
            down_at = sampler.first(lambda n: n == 1, stop_t, timeout_s=down_bound_s + 5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{env.diagnostics(sampler)}") from None
        assert DOWN_DELAY_S <= down_at - stop_t <= down_bound_s, env.diagnostics(sampler)
        status = env.status()
        assert status["desiredReplicas"] == 1
        last = status["scalingHistory"][-1]
        assert (last["from"], last["to"]) == (2, 1), status["scalingHistory"]
        events = env.scale_events()
        assert len(events) == 2 and events[1].startswith("scaled 2 -> 1: "), events
        wait_for(lambda: len(env.ready_pods()) == 1, timeout_s=60, what="one pod left")

        total = sum(r.num_requests for r in load.reports)
        ok = sum(r.num_ok for r in load.reports)
        assert ok == total <= MAX_LOAD_REQUESTS, [r.errors for r in load.reports]
        print(
            f"\nload: {ok} requests in {len(load.reports)} batches; up {up_at - load_t0:.1f}s "
            f"after the load started (bound {bound_s}s); down {down_at - stop_t:.1f}s after it "
            f"stopped (bounds {DOWN_DELAY_S}..{down_bound_s}s)\n{sampler.timeline()}"
        )
    finally:
        if load is not None:
            load.stop()
        sampler.stop()
