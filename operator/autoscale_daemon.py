"""The per-model autoscaling daemon: pods -> scrape -> windows -> decide -> scale, status, event.

`autoscale_tick` is one round with every dependency injected (`AutoscalerApi`, a scrape
function, clocks), so tests drive it without kopf or a cluster; `run_autoscaler` loops it every
scrapeIntervalSeconds; `autoscale_daemon` is the thin kopf adapter the operator registers:

    kopf.daemon(GROUP, VERSION, PLURAL, when=autoscaling_enabled)(autoscale_daemon)

Promises: the daemon is the only writer of spec.replicas while autoscaling is on (through the
scale subresource); it writes status.desiredReplicas, .metrics, .lastScaleTime, the last 5
.scalingHistory entries and the ScalingActive / ScalingLimited conditions with server-side
apply under its own field manager (other conditions are left to their owners); each scale
emits one event ("scaled 1 -> 3: generation tokens/s 5,400 over target 1,000 per replica").
A failing API call or scrape never stops the loop: it is logged and the next tick retries.
Every API call goes through the operator's one `KubeApi` (a timeout on each), the pods come
from the reconciler's owner-matched watch (the router's pods too: with routing mode router
their held, in-flight and finished requests feed `decide`, which scales from and to zero on
them, `router_scrape.py`), spec.autoscaling is read with the spec's own
typed model and the names are the manifests' constants.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from kubeinfer.operator.autoscale_types import (
    Decision,
    MetricName,
    Observation,
    PodSample,
    PodTarget,
    Policy,
    RouterDemand,
    ScalerState,
)
from kubeinfer.operator.autoscaler import decide
from kubeinfer.operator.kube import KubeApi
from kubeinfer.operator.manifests import API_VERSION, KIND, PORT, PROBE_PORT, selector_string
from kubeinfer.operator.scrape import SampleStore
from kubeinfer.operator.spec import AutoscalingSpec, InvalidSpecError

logger = logging.getLogger(__name__)

FIELD_MANAGER = "kubeinfer-autoscaler"
NUM_HISTORY = 5
MEMO_KEY = "autoscaler"


@dataclass(slots=True, frozen=True)
class AutoscalingSettings:
    """spec.autoscaling, parsed (defaults as in the CRD)."""

    is_enabled: bool
    metric: MetricName
    target_per_replica: float
    scrape_interval_s: float
    policy: Policy
    # spec.autoscaling.additionalMetrics as (metric, target per replica); decide takes the max
    additional_metrics: tuple[tuple[MetricName, float], ...] = ()

    @property
    def targets(self) -> tuple[tuple[MetricName, float], ...]:
        """Every metric to scale on with its target: the primary first."""
        return ((self.metric, self.target_per_replica), *self.additional_metrics)


def settings_from_spec(spec: Mapping[str, Any]) -> AutoscalingSettings:
    """spec.autoscaling through the same typed model `parse_spec` uses (its defaults are the
    CRD's); InvalidSpecError when it does not parse."""
    try:
        a = AutoscalingSpec.model_validate(dict(spec.get("autoscaling") or {}))
    except ValidationError as exc:
        raise InvalidSpecError(f"spec.autoscaling: {exc.errors()[0]['msg']}") from exc
    policy = Policy(
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        stable_window_s=float(a.stable_window_seconds),
        panic_window_s=float(a.panic_window_seconds),
        scale_down_delay_s=float(a.scale_down_delay_seconds),
        scale_to_zero_after_s=float(a.scale_to_zero_after_seconds),
    )
    return AutoscalingSettings(
        is_enabled=a.enabled,
        metric=a.metric,
        target_per_replica=a.target_per_replica,
        scrape_interval_s=float(a.scrape_interval_seconds),
        policy=policy,
        additional_metrics=tuple((m.metric, m.target_per_replica) for m in a.additional_metrics),
    )


def autoscaling_enabled(spec: Mapping[str, Any], **_: Any) -> bool:
    """kopf `when=` filter: run the daemon only for models with autoscaling on."""
    return bool((spec.get("autoscaling") or {}).get("enabled", False))


@dataclass(slots=True)
class PodInfo:
    name: str
    ip: str
    is_ready: bool


class AutoscalerApi(Protocol):
    """What the daemon needs from the API server (for one model)."""

    async def list_pods(self, selector: str) -> list[PodInfo]: ...
    async def scale(self, replicas: int) -> None: ...
    async def apply_status(self, status: dict[str, Any]) -> None: ...
    async def event(self, reason: str, message: str) -> None: ...


Scrape = Callable[[list[PodTarget]], Awaitable[list[PodSample]]]
#: The model's demand as its router pods see it (None: the model has no router).
ScrapeRouter = Callable[[], Awaitable[RouterDemand | None]]


@dataclass
class AutoscalerMemory:
    """What survives between ticks (kept in kopf's per-object memo)."""

    store: SampleStore
    state: ScalerState = field(default_factory=ScalerState)
    history: list[dict[str, Any]] = field(default_factory=list)
    last_scale_time: str | None = None
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)  # type -> (status, t)
    last_status: dict[str, Any] | None = None


def new_memory(settings: AutoscalingSettings) -> AutoscalerMemory:
    p = settings.policy
    retention = max(p.stable_window_s, p.panic_window_s) + 3 * settings.scrape_interval_s
    return AutoscalerMemory(
        SampleStore(retention_s=retention, grace_s=settings.scrape_interval_s / 2)
    )


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(
    mem: AutoscalerMemory, kind: str, is_true: bool, reason: str, message: str, now: str
) -> dict[str, Any]:
    status = "True" if is_true else "False"
    prev = mem.transitions.get(kind)
    since = prev[1] if prev and prev[0] == status else now
    mem.transitions[kind] = (status, since)
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
    }


async def autoscale_tick(
    *,
    spec: Mapping[str, Any],
    selector: str,
    api: AutoscalerApi,
    scrape: Scrape,
    memory: AutoscalerMemory,
    now: float,
    wall_now: dt.datetime,
    scrape_router: ScrapeRouter | None = None,
) -> Decision:
    """One round: list pods, scrape the ready ones (and the router's), decide, scale if
    needed, write status."""
    settings = settings_from_spec(spec)
    current = int(spec.get("replicas", 1))
    pods = await api.list_pods(selector)
    ready = [p for p in pods if p.is_ready and p.ip]
    samples = await scrape(
        [PodTarget(p.name, f"http://{p.ip}:{PROBE_PORT}/metrics") for p in ready]
    )
    store = memory.store
    store.add(samples)
    store.retain([p.name for p in pods], now)
    policy = settings.policy
    ready_names = [p.name for p in ready]
    readings = tuple(
        store.reading(
            metric,
            target,
            ready_pods=ready_names,
            now=now,
            stable_window_s=policy.stable_window_s,
            panic_window_s=policy.panic_window_s,
        )
        for metric, target in settings.targets
    )
    router = await scrape_router() if scrape_router is not None else None
    observation = Observation(now, current, len(ready), readings, router)
    decision = decide(policy, observation, memory.state)
    memory.state = decision.state
    stamp = _iso(wall_now)
    if decision.replicas != current:
        await api.scale(decision.replicas)
        message = f"scaled {current} -> {decision.replicas}: {decision.reason}"
        logger.info("%s", message)
        memory.history = [
            *memory.history,
            {"time": stamp, "from": current, "to": decision.replicas, "reason": decision.reason},
        ][-NUM_HISTORY:]
        memory.last_scale_time = stamp
        await api.event("Scaled", message)
    snapshot = store.snapshot(ready_names, now, policy.stable_window_s)
    num_with_data = max(r.num_stable_pods for r in readings)
    await _write_status(api, memory, decision, snapshot, num_with_data, len(ready), stamp)
    return decision


async def _write_status(
    api: AutoscalerApi,
    memory: AutoscalerMemory,
    decision: Decision,
    snapshot: Mapping[str, float],
    num_with_data: int,
    num_ready: int,
    stamp: str,
) -> None:
    if num_with_data:
        active = _condition(
            memory, "ScalingActive", True, "ValidMetricFound", decision.reason, stamp
        )
    else:
        why = "no ready pods" if num_ready == 0 else "no pod's metrics could be read"
        active = _condition(memory, "ScalingActive", False, "FailedGetMetrics", why, stamp)
    if not decision.is_limited:
        reason, message = "DesiredWithinRange", "the recommendation is within [min, max]"
    elif decision.recommended > decision.replicas:
        reason, message = "TooManyReplicas", decision.limited_reason
    else:
        reason, message = "TooFewReplicas", decision.limited_reason
    limited = _condition(memory, "ScalingLimited", decision.is_limited, reason, message, stamp)
    status: dict[str, Any] = {
        "desiredReplicas": decision.replicas,
        "scalingHistory": memory.history,
        "conditions": [active, limited],
    }
    if snapshot:
        status["metrics"] = {k: round(v, 3) for k, v in snapshot.items()}
    # else left out: apply then drops the stale values, whereas an applied `metrics: {}` that
    # empties what this manager owned becomes null, which the schema refuses (422)
    if memory.last_scale_time:
        status["lastScaleTime"] = memory.last_scale_time
    if status != memory.last_status:
        await api.apply_status(status)
        memory.last_status = status


async def run_autoscaler(
    *,
    read_spec: Callable[[], Mapping[str, Any]],
    read_selector: Callable[[], str],
    api: AutoscalerApi,
    scrape: Scrape,
    memory: AutoscalerMemory,
    is_stopped: Callable[[], bool],
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    scrape_router: ScrapeRouter | None = None,
) -> None:
    """Tick every scrapeIntervalSeconds until stopped or autoscaling is turned off."""
    while not is_stopped():
        spec = read_spec()
        settings = settings_from_spec(spec)
        if not settings.is_enabled:
            return
        try:
            await autoscale_tick(
                spec=spec,
                selector=read_selector(),
                api=api,
                scrape=scrape,
                memory=memory,
                now=clock(),
                wall_now=wall_clock(),
                scrape_router=scrape_router,
            )
        except Exception:  # noqa: BLE001 - one bad round (API hiccup) must not end scaling
            logger.exception("autoscaler tick failed; retrying next interval")
        await sleep(settings.scrape_interval_s)


def pod_infos(pods: Iterable[Mapping[str, Any]]) -> list[PodInfo]:
    """Pods (API JSON) as PodInfo, terminating ones left out (they are no capacity)."""
    out = []
    for pod in pods:
        status = pod.get("status") or {}
        if pod["metadata"].get("deletionTimestamp"):
            continue
        is_ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        out.append(PodInfo(pod["metadata"]["name"], status.get("podIP") or "", is_ready))
    return out


class KubeAutoscalerApi:
    """AutoscalerApi for one model on the operator's own `KubeApi` (async, a timeout on every
    call) and the reconciler's watch of the model's pods (owner-matched: no list call)."""

    def __init__(
        self,
        api: KubeApi,
        pods: Callable[[], Iterable[Mapping[str, Any]]],
        *,
        namespace: str,
        name: str,
        uid: str,
    ) -> None:
        self.api, self._pods = api, pods
        self.namespace, self.name, self.uid = namespace, name, uid

    async def list_pods(self, selector: str) -> list[PodInfo]:
        return pod_infos(self._pods())

    async def scale(self, replicas: int) -> None:
        await self.api.scale_model(self.namespace, self.name, replicas)

    async def apply_status(self, status: dict[str, Any]) -> None:
        await self.api.apply_model_status(
            self.namespace, self.name, status, field_manager=FIELD_MANAGER
        )

    async def event(self, reason: str, message: str) -> None:
        model = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": self.name, "namespace": self.namespace, "uid": self.uid},
        }
        await self.api.create_event(model, "Normal", reason, message, FIELD_MANAGER)


async def autoscale_daemon(
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    name: str,
    namespace: str,
    uid: str,
    memo: MutableMapping[str, Any],
    stopped: Any,
    **_: Any,
) -> None:
    """kopf daemon (per InferenceModel with autoscaling on); kopf's spec/status are live views.

    Writes through the reconciler's `KubeApi` and reads the model's pods from its watch
    (`memo["reconciler"]`). The scaler's windows and state live in `memo["autoscaler"]`, so a
    daemon restarted by kopf keeps them.
    """
    import httpx

    from kubeinfer.operator.router_scrape import scrape_routers
    from kubeinfer.operator.scrape import scrape_pods

    reconciler = memo["reconciler"]
    api = KubeAutoscalerApi(
        reconciler.api,
        lambda: reconciler.owned_pods((namespace, name)).values(),
        namespace=namespace,
        name=name,
        uid=uid,
    )
    settings = settings_from_spec(spec)
    memory = memo.get(MEMO_KEY)
    if not isinstance(memory, AutoscalerMemory):
        memory = memo[MEMO_KEY] = new_memory(settings)
    timeout_s = min(2.0, settings.scrape_interval_s / 2)
    async with httpx.AsyncClient() as client:

        async def scrape(targets: list[PodTarget]) -> list[PodSample]:
            return await scrape_pods(client, targets, timeout_s=timeout_s)

        async def scrape_router() -> RouterDemand | None:
            if ((spec.get("routing") or {}).get("mode") or "router") != "router":
                return None
            pods = pod_infos(reconciler.owned_router_pods((namespace, name)).values())
            targets = [
                PodTarget(p.name, f"http://{p.ip}:{PORT}/metrics")
                for p in pods
                if p.is_ready and p.ip
            ]
            return await scrape_routers(client, targets, timeout_s=timeout_s)

        await run_autoscaler(
            read_spec=lambda: spec,
            read_selector=lambda: (status or {}).get("selector") or selector_string(name),
            api=api,
            scrape=scrape,
            memory=memory,
            is_stopped=lambda: bool(stopped),
            scrape_router=scrape_router,
        )
