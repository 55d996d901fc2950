"""The daemon body with fakes for the API and the scrape: scale, status, event, failures."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from kubeinfer.operator.autoscale_daemon import (
    PodInfo,
    autoscale_tick,
    new_memory,
    run_autoscaler,
    settings_from_spec,
)
from kubeinfer.operator.autoscale_types import PodSample, PodTarget

WALL = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.UTC)


def model_spec(replicas: int = 1, **autoscaling: Any) -> dict[str, Any]:
    a = {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetPerReplica": 1000}
    a |= {"stableWindowSeconds": 10, "panicWindowSeconds": 4, "scaleDownDelaySeconds": 20}
    return {"replicas": replicas, "autoscaling": {**a, "scrapeIntervalSeconds": 2, **autoscaling}}


class FakeCluster:
    """Pods with generation counters growing at `rate` tok/s each; failing pods raise."""

    def __init__(self, spec: dict[str, Any], num_ready: int, rate: float) -> None:
        self.spec, self.rate, self.now = spec, rate, 0.0
        self.pods = [PodInfo(f"p{i}", f"127.1.0.{i + 1}", True) for i in range(num_ready)]
        self.failing: set[str] = set()
        self.waiting: float | None = None  # each pod's vllm:num_requests_waiting, when set
        self.scaled: list[int] = []
        self.statuses: list[dict[str, Any]] = []
        self.events: list[tuple[str, str]] = []

    async def list_pods(self, selector: str) -> list[PodInfo]:
        assert selector == "app.kubernetes.io/instance=m"
        return list(self.pods)

    async def scale(self, replicas: int) -> None:
        self.scaled.append(replicas)
        self.spec["replicas"] = replicas
        while len(self.pods) < replicas:  # new pods start (not ready) until a test says so
            self.pods.append(PodInfo(f"p{len(self.pods)}", "", False))

    async def apply_status(self, status: dict[str, Any]) -> None:
        self.statuses.append(status)

    async def event(self, reason: str, message: str) -> None:
        self.events.append((reason, message))

    async def scrape(self, targets: list[PodTarget]) -> list[PodSample]:
        assert all(t.url.endswith(":8001/metrics") for t in targets)  # the probe port
        gauges = {} if self.waiting is None else {"vllm:num_requests_waiting": self.waiting}
        return [
            PodSample(t.name, self.now, error="ConnectTimeout")
            if t.name in self.failing
            else PodSample(
                t.name, self.now, {"vllm:generation_tokens_total": self.rate * self.now}, gauges
            )
            for t in targets
        ]

    def tick(self, memory: Any) -> Any:
        return asyncio.run(
            autoscale_tick(
                spec=self.spec,
                selector="app.kubernetes.io/instance=m",
                api=self,
                scrape=self.scrape,
                memory=memory,
                now=self.now,
                wall_now=WALL + dt.timedelta(seconds=self.now),
            )
        )


def run_ticks(cluster: FakeCluster, memory: Any, until: float, step: float = 2.0) -> None:
    while cluster.now <= until:
        cluster.tick(memory)
        cluster.now += step


def test_load_scales_up_with_an_event_history_and_status() -> None:
    spec = model_spec()
    cluster = FakeCluster(spec, num_ready=1, rate=3000)
    memory = new_memory(settings_from_spec(spec))
    run_ticks(cluster, memory, until=2)
    assert cluster.scaled == [2]
    reason, message = cluster.events[0]
    assert reason == "Scaled"
    assert message.startswith("scaled 1 -> 2: generation tokens/s 3,000 over target 1,000")
    status = cluster.statuses[-1]
    assert status["desiredReplicas"] == 2
    assert status["metrics"]["generationTokensPerSecond"] == 3000
    assert status["lastScaleTime"] == "2026-12-02T12:00:02Z"
    assert status["scalingHistory"] == [
        {"time": "2026-12-02T12:00:02Z", "from": 1, "to": 2, "reason": message.split(": ", 1)[1]}
    ]
    types = {c["type"]: c for c in status["conditions"]}
    assert types["ScalingActive"]["status"] == "True"
    assert types["ScalingLimited"]["status"] == "False"
    # the step cap lifted, the rest of the shortfall follows; pods still starting count as
    # capacity on its way, so the same shortfall is not asked for again
    run_ticks(cluster, memory, until=20)
    assert cluster.scaled == [2, 3]


def test_max_replicas_is_reported_as_scaling_limited() -> None:
    spec = model_spec(replicas=4)
    cluster = FakeCluster(spec, num_ready=4, rate=5000)
    memory = new_memory(settings_from_spec(spec))
    run_ticks(cluster, memory, until=4)
    limited = {c["type"]: c for c in cluster.statuses[-1]["conditions"]}["ScalingLimited"]
    assert limited["status"] == "True" and limited["reason"] == "TooManyReplicas"
    assert "maxReplicas 4" in limited["message"] and cluster.scaled == []


def test_failed_scrapes_under_load_never_scale_down() -> None:
    spec = model_spec(replicas=3)
    cluster = FakeCluster(spec, num_ready=3, rate=1000)
    memory = new_memory(settings_from_spec(spec))
    run_ticks(cluster, memory, until=10)
    cluster.failing = {"p1", "p2"}  # two of three pods stop answering
    run_ticks(cluster, memory, until=60)
    cluster.failing = {"p0", "p1", "p2"}
    run_ticks(cluster, memory, until=100)
    assert cluster.scaled == []
    active = {c["type"]: c for c in cluster.statuses[-1]["conditions"]}["ScalingActive"]
    assert active["status"] == "False" and active["reason"] == "FailedGetMetrics"


def test_status_without_any_readable_metric_leaves_metrics_out() -> None:
    """Server-side apply turns an applied `metrics: {}` into null, which the CRD refuses (422):
    the whole status write failed, so ScalingActive never turned False on the dev cluster.
    With nothing read, `metrics` is left out (apply then removes the stale values)."""
    spec = model_spec(replicas=2)
    cluster = FakeCluster(spec, num_ready=2, rate=1000)
    memory = new_memory(settings_from_spec(spec))
    run_ticks(cluster, memory, until=6)
    assert cluster.statuses[-1]["metrics"]["generationTokensPerSecond"] == 2000
    cluster.failing = {"p0", "p1"}
    run_ticks(cluster, memory, until=12)
    status = cluster.statuses[-1]
    assert "metrics" not in status
    active = {c["type"]: c for c in status["conditions"]}["ScalingActive"]
    assert active["status"] == "False" and active["reason"] == "FailedGetMetrics"


def test_idle_scales_down_after_the_delay_and_history_keeps_five() -> None:
    spec = model_spec(replicas=4)
    cluster = FakeCluster(spec, num_ready=4, rate=0)
    memory = new_memory(settings_from_spec(spec))
    memory.history = [{"time": "t", "from": 1, "to": 1, "reason": "old"}] * 5
    run_ticks(cluster, memory, until=18)
    assert cluster.scaled == [], "nothing before scaleDownDelaySeconds"
    run_ticks(cluster, memory, until=40)
    assert cluster.scaled == [2, 1]  # at most halving per step
    history = cluster.statuses[-1]["scalingHistory"]
    assert len(history) == 5 and [h["to"] for h in history[-2:]] == [2, 1]


def test_loop_survives_a_failing_round_and_stops_when_disabled() -> None:
    spec = model_spec()
    cluster = FakeCluster(spec, num_ready=1, rate=500)
    calls = {"n": 0}

    async def flaky_list(selector: str) -> list[PodInfo]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("API server hiccup")
        if calls["n"] == 3:
            spec["autoscaling"]["enabled"] = False
        return list(cluster.pods)

    cluster.list_pods = flaky_list  # type: ignore[method-assign]
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    asyncio.run(
        run_autoscaler(
            read_spec=lambda: spec,
            read_selector=lambda: "app.kubernetes.io/instance=m",
            api=cluster,
            scrape=cluster.scrape,
            memory=new_memory(settings_from_spec(spec)),
            is_stopped=lambda: len(slept) > 10,
            sleep=sleep,
        )
    )
    assert calls["n"] == 3 and slept == [2.0, 2.0, 2.0]


WAITING = [{"metric": "requestsWaiting", "targetPerReplica": 5}]


def test_additional_metrics_are_parsed_primary_first() -> None:
    settings = settings_from_spec(model_spec(additionalMetrics=WAITING))
    assert settings.targets == (("generationTokensPerSecond", 1000.0), ("requestsWaiting", 5.0))
    assert settings_from_spec(model_spec()).targets == (("generationTokensPerSecond", 1000.0),)


def test_a_queue_scales_up_saturated_pods_that_throughput_alone_holds() -> None:
    """Two pods generate 1,050 tok/s each (within tolerance of 1,000: they are saturated and
    cannot show more) while 10 requests wait on each: the queue asks 20 / 5 = 4."""
    runs = {}
    for name, extra in (("alone", {}), ("with queue", {"additionalMetrics": WAITING})):
        spec = model_spec(replicas=2, maxReplicas=8, **extra)
        cluster = FakeCluster(spec, num_ready=2, rate=1050)
        cluster.waiting = 10
        memory = new_memory(settings_from_spec(spec))
        run_ticks(cluster, memory, until=10)
        runs[name] = cluster
    assert runs["alone"].scaled == []
    cluster = runs["with queue"]
    assert cluster.scaled == [4], cluster.scaled
    assert "requests waiting 20 over target 5 per replica" in cluster.events[0][1]
    status = cluster.statuses[-1]
    assert status["metrics"]["requestsWaiting"] == 20
    assert {c["type"]: c for c in status["conditions"]}["ScalingActive"]["status"] == "True"


def test_an_idle_queue_does_not_block_scale_down() -> None:
    spec = model_spec(replicas=4, additionalMetrics=WAITING)
    cluster = FakeCluster(spec, num_ready=4, rate=0)
    cluster.waiting = 0
    memory = new_memory(settings_from_spec(spec))
    run_ticks(cluster, memory, until=40)
    assert cluster.scaled == [2, 1]  # as without the queue metric


class RecordingKubeApi:
    """The KubeApi calls the daemon's adapter makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def scale_model(self, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        self.calls.append(("scale", namespace, name, replicas))
        return {}

    async def apply_model_status(
        self, namespace: str, name: str, status: dict[str, Any], *, field_manager: str
    ) -> dict[str, Any]:
        self.calls.append(("status", namespace, name, field_manager))
        return {}

    async def create_event(self, obj: dict[str, Any], *args: str) -> None:
        self.calls.append(("event", obj["kind"], obj["metadata"]["uid"], *args))


def test_the_adapter_uses_the_operators_api_and_its_owned_pods() -> None:
    """One API layer: the daemon writes through the operator's KubeApi (timeouts on every
    call) and reads the pods the reconciler matched by owner, never a second client."""
    from kubeinfer.operator.autoscale_daemon import FIELD_MANAGER, KubeAutoscalerApi

    ready = {"type": "Ready", "status": "True"}
    pods = [
        {"metadata": {"name": "a"}, "status": {"podIP": "127.1.0.1", "conditions": [ready]}},
        {"metadata": {"name": "b"}, "status": {"podIP": "127.1.0.2"}},
        {"metadata": {"name": "c", "deletionTimestamp": "now"}, "status": {"conditions": [ready]}},
    ]
    kube = RecordingKubeApi()
    api = KubeAutoscalerApi(kube, lambda: pods, namespace="ns", name="m", uid="u1")  # type: ignore[arg-type]

    async def run() -> list[PodInfo]:
        listed = await api.list_pods("ignored")
        await api.scale(3)
        await api.apply_status({"desiredReplicas": 3})
        await api.event("Scaled", "scaled 1 -> 3")
        return listed

    listed = asyncio.run(run())
    assert listed == [PodInfo("a", "127.1.0.1", True), PodInfo("b", "127.1.0.2", False)]
    assert kube.calls == [
        ("scale", "ns", "m", 3),
        ("status", "ns", "m", FIELD_MANAGER),
        ("event", "InferenceModel", "u1", "Normal", "Scaled", "scaled 1 -> 3", FIELD_MANAGER),
    ]


def test_settings_parse_with_the_specs_own_model() -> None:
    import pytest

    from kubeinfer.operator.spec import InvalidSpecError

    settings = settings_from_spec({"autoscaling": {"enabled": True}})
    assert settings.policy.max_replicas == 4 and settings.scrape_interval_s == 5.0  # CRD's
    with pytest.raises(InvalidSpecError, match="spec.autoscaling"):
        settings_from_spec({"autoscaling": {"metric": "qps"}})
