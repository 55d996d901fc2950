"""The operator's level-triggered core: watch event -> key -> `reconcile(key)` -> plan -> writes.

kopf handlers (`handlers.py`) only call `observe(kind, event_type, body)`: the object goes into
the `Store` (what the watches show) and the model's key (namespace, name) into the `WorkQueue`
(deduplicated, one reconcile per key at a time, retries with backoff, periodic resync; a model
without its Deployment is urgent). `reconcile(key)` then:

1. reads a `Snapshot`: the model and each child (`manifests.CHILDREN`) as the watches show them; a
   rendered child the watches do not show is read with a GET (the watches only see objects with our
   labels, and an object of that name may be someone else's). When there is no Deployment only its
   name is read: the rest waits for the next, non-urgent pass, so a burst of new models gets its
   Deployments first. The model's pods (owner-matched) come with their runtime's last /ready, read
   (bounded) from each running pod that is not ready yet, at most once every `pod_probe_interval_s`
   (while one loads, the plan asks to look again then);
2. calls the pure `plan.plan(snapshot)`;
3. carries the plan out with the one `KubeApi`: server-side apply (field manager `kubeinfer`),
   the Deployment's scale subresource, deletes, the status (server-side apply on /status),
   events (best effort). An apply the API server rejects (400/422) makes the model Failed
   (`plan.plan_failure`), and nothing is raised: retrying cannot help. So does an
   InferencePool the API server does not serve (its CRD is not installed), looked at again
   every `plan.MISSING_API_RETRY_S`.

A transient API error propagates: the queue retries the key with backoff. Nothing is kept
between reconciles but what was observed (the watches' objects, the pods' last /ready), so
whatever order events came in, the next reconcile converges; and a reconcile of a world that
is as asked writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import httpx

from kubeinfer.operator.kube import KubeApi, NotFoundError, RejectedError, TransientApiError
from kubeinfer.operator.manifests import (
    CHILD_IDS,
    INFERENCE_POOL_API,
    KIND,
    PROBE_PORT,
    child_id,
    child_ref,
    render,
)
from kubeinfer.operator.metrics import OperatorMetrics
from kubeinfer.operator.plan import MISSING_API_RETRY_S, plan, plan_failure
from kubeinfer.operator.plan_types import Event, Failure, Plan, Snapshot
from kubeinfer.operator.readiness import ReadyReport, read_ready
from kubeinfer.operator.settings import OperatorSettings
from kubeinfer.operator.spec import InvalidSpecError
from kubeinfer.operator.status import PodView, pod_view
from kubeinfer.operator.store import Key, Store, object_key
from kubeinfer.operator.workqueue import WorkQueue

logger = logging.getLogger(__name__)

PROBE_CONCURRENCY = 32
COMPONENT = "kubeinfer-operator"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    def __init__(
        self,
        api: KubeApi,
        settings: OperatorSettings,
        metrics: OperatorMetrics,
        *,
        queue: WorkQueue | None = None,
    ) -> None:
        self.api = api
        self.settings = settings
        self.metrics = metrics
        self.store = Store()
        self.queue = queue or WorkQueue(list_keys=lambda: list(self.store.models))
        metrics.queue_depth.set_function(lambda: len(self.queue))
        self._http: httpx.AsyncClient | None = None
        self._probes = asyncio.Semaphore(PROBE_CONCURRENCY)
        #: (namespace, pod name) -> (when read, the runtime's last /ready): each pod's is read
        #: at most once a probe interval, however many reconciles come in between
        self.reports: dict[Key, tuple[float, ReadyReport]] = {}

    def start(self) -> None:
        """Start the queue's workers (and the client for /ready reads) on the running loop."""
        self._http = httpx.AsyncClient(limits=httpx.Limits(max_connections=PROBE_CONCURRENCY))
        self.queue.start(self.reconcile)  # type: ignore[arg-type]

    async def close(self) -> None:
        await self.queue.close()
        if self._http is not None:
            await self._http.aclose()
        await self.api.close()

    # --- events in ----------------------------------------------------------------------------

    def observe(self, kind: str, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Record one watch event and queue the model it concerns."""
        key = self.store.observe(kind, event_type, body)
        if kind == "Pod" and event_type == "DELETED":
            self.reports.pop(object_key(body), None)
        if kind == KIND:
            self.metrics.models.set(len(self.store.models))
        if key is None:
            return
        if key not in self.store.models:
            self.queue.forget(key)  # gone: its children go with it (garbage collection)
            return
        self.queue.add(key, urgent=self.store.child("Deployment", key) is None)

    def owned_pods(self, key: Key) -> dict[str, dict[str, Any]]:
        """The model's pods (owner-matched), for the autoscaler."""
        return self.store.owned_pods(key)

    def owned_router_pods(self, key: Key) -> dict[str, dict[str, Any]]:
        """The model's router pods (owner-matched), for the autoscaler's demand."""
        return self.store.owned_pods(key, "RouterDeployment")

    # --- one reconcile ------------------------------------------------------------------------

    async def reconcile(self, key: Key) -> float | None:
        """Converge one model; the seconds after which to look again (None: on an event)."""
        model = self.store.models.get(key)
        if model is None:
            return None
        started = time.monotonic()
        try:
            snapshot = await self.snapshot(key, model)
            done = plan(snapshot, self.settings)
            try:
                await self.execute(key, snapshot, done)
            except RejectedError as exc:
                done = plan_failure(snapshot, Failure("InvalidSpec", str(exc)))
                await self.execute(key, snapshot, done)
            except NotFoundError as exc:
                if not any(m["kind"] == "InferencePool" for m in done.applies):
                    raise
                # the group is not served: the CRD is missing, not the model (looked at again)
                failure = Failure(
                    "APINotInstalled",
                    f"routing mode inferencePool needs the InferencePool API "
                    f"({INFERENCE_POOL_API}, from the Gateway API Inference Extension) "
                    f"installed in the cluster: {exc}",
                )
                done = plan_failure(snapshot, failure, requeue_after=MISSING_API_RETRY_S)
                await self.execute(key, snapshot, done)
        except TransientApiError:
            self.metrics.errors.labels("transient").inc()
            self.metrics.reconciles.labels("retry").inc()
            raise
        except NotFoundError as exc:  # the model or its namespace went meanwhile
            logger.info("%s/%s: gone while reconciling: %s", *key, exc)
            return None
        finally:
            self.metrics.duration.observe(time.monotonic() - started)
        if done.failure is not None:
            self.metrics.errors.labels("invalid_spec").inc()
            result = "failed"
        else:
            result = "applied" if done.num_writes else "unchanged"
        self.metrics.reconciles.labels(result).inc()
        return done.requeue_after

    async def snapshot(self, key: Key, model: Mapping[str, Any]) -> Snapshot:
        ns, name = key
        children: dict[str, Mapping[str, Any] | None] = {
            cid: child for cid in CHILD_IDS if (child := self.store.child(cid, key))
        }
        if "Deployment" not in children:  # the one read on a new model's critical path
            children["Deployment"] = await self.api.get("Deployment", ns, name)
        if children["Deployment"] is not None:  # else a first pass: the Deployment alone
            try:
                wanted = [child_id(m, name) for m in render(model, self.settings)]
            except InvalidSpecError:
                wanted = []  # the plan says why
            # owned children no longer rendered are in the store (the watches show them)
            unread = [cid for cid in wanted if cid not in children]
            refs = [child_ref(cid, name) for cid in unread]
            read = await asyncio.gather(*(self.api.get(kind, ns, obj) for kind, obj in refs))
            children.update(zip(unread, read, strict=True))
        return Snapshot(model, children, await self.pod_views(key), now=_now())

    async def pod_views(self, key: Key) -> list[PodView]:
        pods = [
            pod
            for _, pod in sorted(self.store.owned_pods(key).items())
            if not pod["metadata"].get("deletionTimestamp")
        ]
        reports = await asyncio.gather(*(self._ready_report(pod) for pod in pods))
        return [pod_view(pod, report) for pod, report in zip(pods, reports, strict=True)]

    async def _ready_report(self, pod: Mapping[str, Any]) -> ReadyReport | None:
        """The runtime's last /ready of a running pod that is not ready (None for the others),
        read again once it is a probe interval old."""
        view, ip = pod_view(pod, None), (pod.get("status") or {}).get("podIP")
        pod_key = object_key(pod)
        if view.is_ready or not view.is_running or not ip or self._http is None:
            self.reports.pop(pod_key, None)
            return None
        read_at, report = self.reports.get(pod_key, (-float("inf"), None))
        if report is None or time.monotonic() - read_at >= self.settings.pod_probe_interval_s * 0.9:
            async with self._probes:
                timeout_s = self.settings.pod_probe_timeout_s
                report = await read_ready(self._http, ip, PROBE_PORT, timeout_s)
            self.reports[pod_key] = (time.monotonic(), report)
        return report

    async def execute(self, key: Key, snapshot: Snapshot, todo: Plan) -> None:
        ns, name = key
        results = await asyncio.gather(
            *(self.api.apply(m) for m in todo.applies), return_exceptions=True
        )
        if errors := [r for r in results if isinstance(r, BaseException)]:
            raise errors[0]
        if todo.applies:
            logger.info("%s/%s: applied %s", ns, name, ", ".join(m["kind"] for m in todo.applies))
        if todo.scale is not None:
            await self.api.scale_deployment(ns, name, todo.scale)
        for child in todo.deletes:
            kind, obj_name = child_ref(child, name)
            if await self.api.delete(kind, ns, obj_name):  # False: gone already (a stale watch)
                logger.info("%s/%s: deleted %s %s (no longer wanted)", ns, name, kind, obj_name)
        for child in todo.repairs:
            self.metrics.drift_repairs.labels(child).inc()
        if todo.status is not None:
            await self.api.apply_model_status(ns, name, todo.status)
            self.metrics.status_writes.inc()
        for event in todo.events:
            await self.post(snapshot.model, event)

    async def post(self, model: Mapping[str, Any], event: Event) -> None:
        """A Kubernetes event about `model` (best effort: a failure is only logged)."""
        if event.type == "Warning":
            logger.warning("%s/%s: %s: %s", *object_key(model), event.reason, event.message)
        try:
            await self.api.create_event(
                dict(model), event.type, event.reason, event.message, COMPONENT
            )
        except Exception as exc:  # noqa: BLE001 - an event is best effort
            logger.warning(
                "event %s for %s/%s not posted: %s", event.reason, *object_key(model), exc
            )
