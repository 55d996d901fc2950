"""The operator's loop body: apply a model's children, repair drift, keep its status current.

`Reconciler` holds what the watches have shown (models, children, pods, the runtime's last
/ready per pod) and does every write. kopf handlers (`handlers.py`) only feed it events and
call `apply`. Promises:

- `apply(model)` renders and server-side applies every child (field manager `kubeinfer`),
  deletes a PDB that is no longer wanted, and carries spec.replicas to the Deployment's scale
  subresource when autoscaling is on. Transient API errors propagate as `TransientApiError`
  (the handler turns them into `kopf.TemporaryError`); a spec the operator cannot serve, or
  one the API server rejects, becomes status Failed with the reason, and nothing is raised.
- A child that is deleted, or whose applied fields are edited, is re-applied as soon as its
  watch event arrives (counted in `kubeinfer_operator_drift_repairs`, and an event); drift
  seen while a repair runs gets another repair after it.
- Status is recomputed (coalesced per model) on every change of the Deployment or a pod and
  every `pod_probe_interval_s` while pods are not ready (their /ready tells load progress and
  load errors); it is written with server-side apply only when it changed. A change that
  arrives while a write is in flight gets a write of its own after it, and one computed
  while an apply runs waits for it (observedGeneration never lags what the status shows).
- Only one apply per model runs at a time.
- What one apply does is decided by `plan.plan_children` (pure) from a snapshot of the
  model and each child name; this class reads the snapshot and carries the plan out.
- Nothing the model does not own is ever adopted: before a child is applied, an object of
  that name must be absent or carry the model's owner reference. Another's object makes the
  model Failed with a reason naming it (`NotOwnedError`; the handler retries slowly, so the
  model recovers once the object is gone); one still owned by an earlier model of the same
  name (garbage collection pending) is a transient wait. Only owned children are deleted.
- A model's pods are those whose controller is a ReplicaSet of the model's own Deployment
  (owner references, as the Deployment controller sets them): labels alone can be copied by
  any pod, which would then be counted and have its /ready read.
- A model's missing Deployment is its first write, and an urgent one; its other children,
  status writes and events wait until no urgent write has been in flight for a moment
  (`write_priority.py`), so a burst of new models gets its Deployments first. kopf's own
  annotation patch follows the create handler, so it comes after them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from kubeinfer.operator.drift import first_difference
from kubeinfer.operator.kube import ApiError, KubeApi, RejectedError, TransientApiError
from kubeinfer.operator.manifests import INSTANCE_LABEL, PROBE_PORT, render
from kubeinfer.operator.metrics import OperatorMetrics
from kubeinfer.operator.plan import (
    CHILD_KINDS,
    ChildPlan,
    is_owned,
    plan_children,
    scale_target,
)
from kubeinfer.operator.readiness import ReadyReport, read_ready
from kubeinfer.operator.settings import OperatorSettings
from kubeinfer.operator.spec import InvalidSpecError, parse_spec
from kubeinfer.operator.status import compute_status, is_same_status, pod_view
from kubeinfer.operator.write_priority import WritePriority

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, model name)
STATUS_DEBOUNCE_S = 0.2
PROBE_CONCURRENCY = 32
COMPONENT = "kubeinfer-operator"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _generation(obj: Mapping[str, Any]) -> int:
    return int((obj.get("metadata") or {}).get("generation") or 0)


def _key(obj: Mapping[str, Any]) -> Key:
    meta = obj["metadata"]
    return meta["namespace"], meta["name"]


class NotOwnedError(RuntimeError):
    """An object the model would create exists and belongs to someone else."""


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")  # type: ignore[no-any-return]
    return None


@dataclass
class ModelState:
    """What the operator knows of one model beyond its object."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    failure: str | None = None
    failure_reason: str = "InvalidSpec"  # the Ready condition's reason while failed
    observed_generation: int = 0
    has_applied: bool = False
    repair_task: asyncio.Task[None] | None = None
    status_task: asyncio.Task[None] | None = None
    is_status_stale: bool = False  # a change came after the running status task computed
    has_unchecked_children: bool = False  # child events came before the first apply ended
    next_repair: str | None = None  # drift seen while a repair ran: the reason of one more


class Reconciler:
    def __init__(self, api: KubeApi, settings: OperatorSettings, metrics: OperatorMetrics) -> None:
        self.api = api
        self.settings = settings
        self.metrics = metrics
        self.models: dict[Key, dict[str, Any]] = {}
        self.children: dict[tuple[str, str, str], dict[str, Any]] = {}  # (kind, ns, name)
        self.pods: dict[Key, dict[str, dict[str, Any]]] = {}  # model -> pod name -> pod
        # (ns, ReplicaSet name) -> (its uid, its controller's uid): pods -> Deployment
        self.replicasets: dict[Key, tuple[str, str | None]] = {}
        self.reports: dict[Key, ReadyReport] = {}  # (ns, pod name) -> last /ready
        self.states: dict[Key, ModelState] = {}
        self._http: httpx.AsyncClient | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.priority = WritePriority()

    def state(self, key: Key) -> ModelState:
        return self.states.setdefault(key, ModelState())

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._http = httpx.AsyncClient(limits=httpx.Limits(max_connections=PROBE_CONCURRENCY))
        self._probe_task = asyncio.create_task(self._probe_loop(), name="kubeinfer-pod-probes")

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
        for st in self.states.values():
            for task in (st.repair_task, st.status_task):
                if task is not None:
                    task.cancel()
        if self._http is not None:
            await self._http.aclose()
        await self.api.close()

    # --- what the watches show ----------------------------------------------------------------

    def observe_model(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        key = _key(body)
        if event_type == "DELETED":
            self.models.pop(key, None)
            st = self.states.pop(key, None)
            if st is not None:
                for task in (st.repair_task, st.status_task):
                    if task is not None:
                        task.cancel()
        else:
            self.models[key] = dict(body)
        self.metrics.models.set(len(self.models))

    def observe_child(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        kind, (ns, name) = body["kind"], _key(body)
        if event_type == "DELETED":
            self.children.pop((kind, ns, name), None)
        else:
            self.children[(kind, ns, name)] = dict(body)
        model = self.models.get((ns, name))
        if model is None or not self._is_owned(body, model):
            return
        st = self.state((ns, name))
        if kind == "Deployment":
            self.request_status((ns, name))
        if not st.has_applied:
            st.has_unchecked_children = True  # the first apply looks once it is done
            return
        if st.failure:
            return  # the spec cannot be served: there is nothing to repair towards
        wanted = {m["kind"]: m for m in self._render_quietly(model)}
        self._check_child((ns, name), model, wanted, kind, event_type, body)

    def _check_child(
        self,
        key: Key,
        model: Mapping[str, Any],
        wanted: Mapping[str, Mapping[str, Any]],
        kind: str,
        event_type: str | None,
        body: Mapping[str, Any] | None,
    ) -> None:
        """Schedule a repair when child `body` (None: gone) is not what `model` wants."""
        name = key[1]
        if event_type == "DELETED" or body is None:
            if kind in wanted:  # not a child the operator removed itself (a PDB at 1 replica)
                self._schedule_repair(key, f"{kind} {name} was deleted")
            return
        if kind not in wanted:
            self._schedule_repair(key, f"{kind} {name} is no longer wanted")
        elif (where := first_difference(wanted[kind], body)) is not None:
            self._schedule_repair(key, f"{kind} {name} differs at {where}")
        elif kind == "Deployment" and self._replicas_differ(model, body):
            self._schedule_repair(key, f"Deployment {name} has other replicas")

    def _check_children(self, key: Key) -> None:
        """Check every wanted child as the watches show it now: during a model's first apply
        (which waits its turn after the Deployment, `write_priority.py`) `observe_child` only
        notes that events came, so a child deleted or edited then is repaired from here."""
        model, st = self.models.get(key), self.states.get(key)
        if model is None or st is None or st.failure:
            return
        wanted = {m["kind"]: m for m in self._render_quietly(model)}
        for kind in wanted:
            self._check_child(key, model, wanted, kind, None, self.children.get((kind, *key)))

    def observe_pod(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        ns, pod_name = _key(body)
        instance = (body["metadata"].get("labels") or {}).get(INSTANCE_LABEL)
        if not instance:
            return
        pods = self.pods.setdefault((ns, instance), {})
        if event_type == "DELETED":
            pods.pop(pod_name, None)
            self.reports.pop((ns, pod_name), None)
        else:
            pods[pod_name] = dict(body)
        self.request_status((ns, instance))

    def observe_replicaset(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        ns, name = _key(body)
        if event_type == "DELETED":
            self.replicasets.pop((ns, name), None)
        else:
            self.replicasets[(ns, name)] = (body["metadata"].get("uid", ""), _controller_uid(body))
        instance = (body["metadata"].get("labels") or {}).get(INSTANCE_LABEL)
        if instance:
            self.request_status((ns, instance))

    def owned_child(self, kind: str, key: Key) -> dict[str, Any] | None:
        """The model's child of `kind` as the watch shows it; None when absent or another's."""
        model, child = self.models.get(key), self.children.get((kind, *key))
        if model is None or child is None or not self._is_owned(child, model):
            return None
        return child

    def owned_pods(self, key: Key) -> dict[str, dict[str, Any]]:
        """The model's pods by name: those a ReplicaSet of its own Deployment controls."""
        deployment = self.owned_child("Deployment", key)
        pods = self.pods.get(key, {})
        if deployment is None or not pods:
            return {}
        ns, dep_uid = key[0], deployment["metadata"].get("uid")
        rs_uids = {
            uid
            for (rs_ns, _), (uid, owner) in self.replicasets.items()
            if rs_ns == ns and owner == dep_uid and dep_uid
        }
        return {name: p for name, p in pods.items() if _controller_uid(p) in rs_uids}

    @staticmethod
    def _is_owned(child: Mapping[str, Any], model: Mapping[str, Any]) -> bool:
        return is_owned(child, model)

    def _render_quietly(self, model: Mapping[str, Any]) -> list[dict[str, Any]]:
        try:
            return render(model, self.settings)
        except InvalidSpecError:
            return []

    @staticmethod
    def _replicas_differ(model: Mapping[str, Any], deployment: Mapping[str, Any]) -> bool:
        spec = model.get("spec") or {}
        if not (spec.get("autoscaling") or {}).get("enabled"):
            return False  # the applied object carries replicas: first_difference saw it
        return (deployment.get("spec") or {}).get("replicas") != spec.get("replicas", 1)

    # --- writes -------------------------------------------------------------------------------

    async def apply(self, model: Mapping[str, Any], *, reason: str = "") -> None:
        """Render and apply every child of `model`; see the module docstring."""
        key = _key(model)
        self.models.setdefault(key, dict(model))
        st = self.state(key)
        async with st.lock:
            cached = self.models.get(key)  # the freshest copy the watch has, unless older
            if cached is not None and _generation(cached) >= _generation(model):
                model = cached
            started = time.monotonic()
            try:
                changed = await self._apply_children(model)
            except (InvalidSpecError, RejectedError) as exc:
                self._fail(model, st, str(exc))
                return
            except NotOwnedError as exc:
                self._fail(model, st, str(exc), reason="NotOwned")
                raise
            except TransientApiError:
                self.metrics.errors.labels("transient").inc()
                self.metrics.reconciles.labels("retry").inc()
                raise
            finally:
                self.metrics.duration.observe(time.monotonic() - started)
            st.failure, st.has_applied = None, True
            st.observed_generation = int(model["metadata"].get("generation") or 0)
            self.metrics.reconciles.labels("applied").inc()
        if st.has_unchecked_children:
            st.has_unchecked_children = False
            self._check_children(key)
        if changed:
            what = ", ".join(changed)
            if reason:
                for kind in changed:
                    self.metrics.drift_repairs.labels(kind.split(" ")[0]).inc()
                logger.info("%s/%s: repaired (%s): %s", *key, reason, what)
                self.event(model, "Normal", "DriftRepaired", f"{reason}; re-applied {what}")
            else:
                self.event(model, "Normal", "Applied", f"applied {what}")
        self.request_status(key, delay=0)

    async def _apply_children(self, model: Mapping[str, Any]) -> list[str]:
        """Apply what `plan_children` asks for; return the children that changed ("Kind name").

        The Deployment goes first, on its own; a missing one is urgent and every other write
        waits its turn (`write_priority.py`). The watches only see objects with our labels: a
        rendered name they do not show is read just before its write, so a new model's
        critical path holds one read (its Deployment's) and the others wait with their writes."""
        ns, name = _key(model)
        lives = {kind: self.children.get((kind, ns, name)) for kind in CHILD_KINDS}
        plan = self._checked(plan_children(model, lives, self.settings))
        deployment, *others = plan.applies
        spec = parse_spec(model.get("spec") or {})
        is_missing = lives["Deployment"] is None
        if is_missing:
            lives["Deployment"] = await self.api.get("Deployment", ns, name)
            self._checked(plan_children(model, lives, self.settings))
        async with self.priority.urgent() if is_missing else self.priority.deferred():
            changed = await self._apply_manifests([deployment])
        async with self.priority.deferred():
            unknown = [m["kind"] for m in others if lives[m["kind"]] is None]
            read = await asyncio.gather(*(self.api.get(kind, ns, name) for kind in unknown))
            lives.update(zip(unknown, read, strict=True))
            lives["Deployment"] = self.children.get(("Deployment", ns, name))
            plan = self._checked(plan_children(model, lives, self.settings))
            changed += await self._apply_manifests(others)
            # None: deleted while this waited its turn (the check after the apply repairs it)
            target = scale_target(spec, self.children.get(("Deployment", ns, name)))
            if target is not None:
                await self.api.scale_deployment(ns, name, target)
                changed.append(f"Deployment {name} replicas={target}")
            for kind in plan.deletes:
                if await self.api.delete(kind, ns, name):
                    changed.append(f"{kind} {name} (deleted)")
                self.children.pop((kind, ns, name), None)
        return changed

    @staticmethod
    def _checked(plan: ChildPlan) -> ChildPlan:
        """The plan, unless it says the model fails (NotOwnedError, InvalidSpecError) or must
        wait (TransientApiError)."""
        if plan.failure is not None:
            if plan.failure.reason == "NotOwned":
                raise NotOwnedError(plan.failure.message)
            raise InvalidSpecError(plan.failure.message)
        if plan.wait is not None:
            raise TransientApiError(409, plan.wait)
        return plan

    async def _apply_manifests(self, manifests: list[dict[str, Any]]) -> list[str]:
        """Apply independent objects together; return those that changed ("Kind name")."""
        keys = [(m["kind"], *_key(m)) for m in manifests]
        befores = [
            (self.children.get(k) or {}).get("metadata", {}).get("resourceVersion") for k in keys
        ]
        results = await asyncio.gather(*(self.api.apply(m) for m in manifests))
        changed = []
        for key, before, result in zip(keys, befores, results, strict=True):
            self.children[key] = result
            if result["metadata"].get("resourceVersion") != before:
                changed.append(f"{key[0]} {key[2]}")
        return changed

    def _fail(
        self, model: Mapping[str, Any], st: ModelState, message: str, reason: str = "InvalidSpec"
    ) -> None:
        is_new = st.failure != message
        st.failure, st.failure_reason, st.has_applied = message, reason, True
        st.observed_generation = int(model["metadata"].get("generation") or 0)
        self.metrics.errors.labels("invalid_spec").inc()
        self.metrics.reconciles.labels("failed").inc()
        if is_new:
            logger.warning("%s/%s: cannot serve: %s", *_key(model), message)
            self.event(model, "Warning", reason, message)
        self.request_status(_key(model), delay=0)

    def event(self, model: Mapping[str, Any], event_type: str, reason: str, message: str) -> None:
        """Post a Kubernetes event about `model` in the background (a failure is only logged)."""

        async def post() -> None:
            try:
                async with self.priority.deferred():
                    await self.api.create_event(dict(model), event_type, reason, message, COMPONENT)
            except Exception as exc:  # noqa: BLE001 - an event is best effort
                logger.warning("event %s for %s/%s not posted: %s", reason, *_key(model), exc)

        task = asyncio.create_task(post())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _schedule_repair(self, key: Key, reason: str) -> None:
        st = self.state(key)
        if st.repair_task is not None and not st.repair_task.done():
            st.next_repair = reason  # the running repair may have applied before this drift
            return
        st.repair_task = asyncio.create_task(self._repair(key, reason))

    async def _repair(self, key: Key, reason: str) -> None:
        delay = 1.0
        while (model := self.models.get(key)) is not None:
            try:
                await self.apply(model, reason=reason)
            except TransientApiError as exc:
                logger.warning("%s/%s: repair failed, retrying in %.0fs: %s", *key, delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            except ApiError as exc:  # e.g. 404: the namespace or the model is going away
                logger.warning("%s/%s: repair given up: %s", *key, exc)
                return
            except NotOwnedError:
                return  # the model is Failed; its handler retries
            st = self.states.get(key)
            if st is None or st.next_repair is None:
                return
            reason, st.next_repair = st.next_repair, None

    # --- status -------------------------------------------------------------------------------

    def request_status(self, key: Key, delay: float = STATUS_DEBOUNCE_S) -> None:
        """Recompute and write `key`'s status soon (requests within `delay` coalesce)."""
        st = self.states.get(key)
        if st is None:
            return
        if st.status_task is not None and not st.status_task.done():
            st.is_status_stale = True  # the running task writes once more after this one
            return
        st.status_task = asyncio.create_task(self._status_soon(key, st, delay))

    async def _status_soon(self, key: Key, st: ModelState, delay: float) -> None:
        while True:
            await asyncio.sleep(delay)
            # an apply in progress has not yet set observed_generation for what it applies:
            # a status computed now would pair the new Deployment with the old generation
            async with st.lock:
                pass
            try:
                async with self.priority.deferred():
                    st.is_status_stale = False  # what came so far is in the status computed now
                    await self.write_status(key)
            except ApiError as exc:  # a 404 too: the model went while the write was on its way
                logger.warning("%s/%s: status write failed (next change retries): %s", *key, exc)
                return
            if not st.is_status_stale or self.states.get(key) is not st:
                return
            delay = STATUS_DEBOUNCE_S

    def compute(self, key: Key) -> dict[str, Any] | None:
        model, st = self.models.get(key), self.states.get(key)
        if model is None or st is None or not st.has_applied:
            return None
        ns, _ = key
        pods = [
            pod_view(p, self.reports.get((ns, name)))
            for name, p in sorted(self.owned_pods(key).items())
            if not p["metadata"].get("deletionTimestamp")
        ]
        status = compute_status(
            model,
            self.owned_child("Deployment", key),
            pods,
            failure=st.failure,
            failure_reason=st.failure_reason,
            observed_generation=st.observed_generation,
            now=_now(),
        )
        if ((model.get("spec") or {}).get("autoscaling") or {}).get("enabled"):
            del status["desiredReplicas"]  # the autoscaler's field while it runs
        return status

    async def write_status(self, key: Key) -> None:
        status = self.compute(key)
        model = self.models.get(key)
        if status is None or model is None:
            return
        current = model.get("status") or {}
        if is_same_status(current, status):
            return
        result = await self.api.apply_model_status(*key, status)
        self.metrics.status_writes.inc()
        cached = self.models.get(key)
        if cached is not None:  # the reply is the model as it was when the write was sent:
            # a newer spec the watch delivered meanwhile stays, with the status just written
            newer = _generation(result) >= _generation(cached)
            self.models[key] = result if newer else {**cached, "status": result.get("status")}
        if current.get("phase") != status["phase"]:
            kind = "Warning" if status["phase"] in ("Failed", "Degraded") else "Normal"
            self.event(model, kind, status["phase"], status["conditions"][0]["message"])

    # --- the runtime's /ready of pods that are not ready --------------------------------------

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.pod_probe_interval_s)
            try:
                await self.probe_pods()
            except Exception:  # noqa: BLE001 - the loop must survive one bad round
                logger.exception("pod probe round failed")

    async def probe_pods(self) -> None:
        """Read /ready of every running, not-ready runtime pod; refresh statuses that moved."""
        assert self._http is not None, "start() first"
        targets: list[tuple[Key, str, str]] = []
        for key in list(self.pods):
            for name, pod in self.owned_pods(key).items():
                view = pod_view(pod, None)
                ip = (pod.get("status") or {}).get("podIP")
                if view.is_ready or not view.is_running or not ip:
                    self.reports.pop((key[0], name), None)
                elif not pod["metadata"].get("deletionTimestamp"):
                    targets.append((key, name, ip))
        sem = asyncio.Semaphore(PROBE_CONCURRENCY)

        async def one(key: Key, name: str, ip: str) -> None:
            async with sem:
                assert self._http is not None
                report = await read_ready(
                    self._http, ip, PROBE_PORT, self.settings.pod_probe_timeout_s
                )
            if self.reports.get((key[0], name)) != report:
                self.reports[(key[0], name)] = report
                self.request_status(key)

        await asyncio.gather(*(one(*t) for t in targets))
