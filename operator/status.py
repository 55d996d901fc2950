"""An InferenceModel's status from its children (pure): phase, counts, conditions.

Phase: Failed when the spec cannot be served, or no replica is ready and pods report a load
error or crash-loop; Degraded when some but not all asked-for replicas are ready, or ready
pods sit beside failing ones; Ready when all are; Loading while pods run but none is ready
yet; Pending before any pod runs (and when the model is scaled to zero).

Only the fields listed in `OWNED_FIELDS` and the conditions in `OWNED_CONDITIONS` are the
operator's; the autoscaler writes the others (metrics, scalingHistory, ScalingActive, ...)
with its own field manager.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kubeinfer.operator.manifests import RUNTIME_CONTAINER, endpoint, selector_string
from kubeinfer.operator.readiness import ReadyReport

Phase = Literal["Pending", "Loading", "Ready", "Degraded", "Failed"]
OWNED_FIELDS = (
    "phase",
    "replicas",
    "readyReplicas",
    "updatedReplicas",
    "selector",
    "desiredReplicas",
    "observedGeneration",
    "endpoint",
    "servedName",
)
OWNED_CONDITIONS = ("Ready", "Progressing", "Degraded")
#: Container waiting reasons that mean the pod will not become ready by itself.
FAILING_WAIT_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ImageNotMapped",
        "VolumeNotSupported",
    }
)
MAX_MESSAGE = 1000


@dataclass(slots=True, frozen=True)
class PodView:
    """What the status needs to know about one pod."""

    name: str
    is_running: bool
    is_ready: bool
    restart_count: int
    problem: str  # "" when nothing is wrong with it
    progress: str = ""  # "loaded 120 of 270 MB" while the runtime loads


def pod_view(pod: Mapping[str, Any], report: ReadyReport | None) -> PodView:
    """Reduce a pod (API JSON) and its last /ready reading to a PodView."""
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    runtime = next(
        (c for c in status.get("containerStatuses") or [] if c.get("name") == RUNTIME_CONTAINER),
        {},
    )
    state = runtime.get("state") or {}
    waiting = state.get("waiting") or {}
    last = (runtime.get("lastState") or {}).get("terminated") or {}
    problem = ""
    if report is not None and report.state == "failed":
        problem = f"pod {name}: model failed to load: {report.error}"
    elif waiting.get("reason") in FAILING_WAIT_REASONS:
        problem = f"pod {name}: {waiting['reason']}: {waiting.get('message') or ''}".rstrip(": ")
        if last:
            detail = last.get("message") or last.get("reason") or ""
            problem += f" (last exit code {last.get('exitCode')}{': ' + detail if detail else ''})"
    else:
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                problem = f"pod {name}: {cond.get('reason')}: {cond.get('message') or ''}"
    return PodView(
        name=name,
        is_running=state.get("running") is not None,
        is_ready=bool(runtime.get("ready")),
        restart_count=int(runtime.get("restartCount") or 0),
        problem=problem.strip(),
        progress=report.progress if report is not None and report.state == "loading" else "",
    )


def _condition(
    ctype: str, is_true: bool, reason: str, message: str, previous: Mapping[str, Any] | None,
    now: str, generation: int,
) -> dict[str, Any]:  # fmt: skip
    status = "True" if is_true else "False"
    changed = previous is None or previous.get("status") != status
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "lastTransitionTime": now if changed else previous.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }


def compute_status(
    model: Mapping[str, Any],
    deployment: Mapping[str, Any] | None,
    pods: Sequence[PodView],
    *,
    failure: str | None,
    observed_generation: int,
    now: str,
    failure_reason: str = "InvalidSpec",
    router: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The operator's part of `status` (OWNED_FIELDS and OWNED_CONDITIONS). `router`: the
    model's router Deployment in routing mode router; the model is not Ready while its
    endpoint, the router, has no ready pod (phase Degraded, reason RouterNotReady)."""
    meta, spec = model["metadata"], model.get("spec") or {}
    previous = {c.get("type"): c for c in (model.get("status") or {}).get("conditions") or []}
    desired = int(spec.get("replicas", 1))
    dstatus = (deployment or {}).get("status") or {}
    num_pods = int(dstatus.get("replicas") or 0)
    num_ready = int(dstatus.get("readyReplicas") or 0)
    num_updated = int(dstatus.get("updatedReplicas") or 0)
    problems = [p.problem for p in pods if p.problem]
    num_running = sum(p.is_running for p in pods)

    phase: Phase
    if failure:
        phase, reason, message = "Failed", failure_reason, failure
    elif desired == 0:
        phase, reason = "Pending", "ScaledToZero"
        message = "spec.replicas is 0: no pods run"
    elif num_ready >= desired and not problems:
        phase, reason, message = (
            "Ready",
            "AllReplicasReady",
            f"{num_ready}/{desired} replicas ready",
        )
    elif num_ready > 0:
        phase, reason = "Degraded", "ReplicasNotReady"
        message = "; ".join([f"{num_ready}/{desired} replicas ready", *problems])
    elif problems:
        phase, reason, message = "Failed", "PodsFailing", "; ".join(problems)
    elif num_running > 0:
        phase, reason = "Loading", "Loading"
        loading = [f"pod {p.name}: {p.progress}" for p in pods if p.progress]
        message = f"0/{desired} replicas ready: {num_running} loading"
        message += f" ({'; '.join(loading)})" if loading else ""
    else:
        phase, reason = "Pending", "PodsPending"
        message = f"0/{desired} replicas ready: waiting for pods to start"

    if phase == "Ready" and router is not None:
        wanted = int((router.get("spec") or {}).get("replicas", 1) or 0)
        routers_ready = int((router.get("status") or {}).get("readyReplicas") or 0)
        if wanted > 0 and routers_ready == 0:
            phase, reason = "Degraded", "RouterNotReady"
            message = (
                f"{num_ready}/{desired} replicas ready, but 0/{wanted} router pods: the "
                "endpoint answers no request yet"
            )

    is_rolling = bool(deployment) and (
        num_updated < desired or num_pods != desired or num_ready < desired
    )
    progress_failed = any(
        c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
        for c in dstatus.get("conditions") or []
    )
    if failure or progress_failed:
        prog = (False, "Failed", failure or "the rollout exceeded its progress deadline")
    elif is_rolling:
        prog = (True, "RolloutInProgress",
                f"{num_updated}/{desired} updated, {num_ready} ready, {num_pods} pods")  # fmt: skip
    else:
        prog = (False, "Complete", f"{desired} replicas up to date")
    is_degraded = phase in ("Degraded", "Failed")
    degraded_message = message if is_degraded else "all replicas as asked"
    gen = observed_generation
    conditions = [
        _condition("Ready", phase == "Ready", reason, message, previous.get("Ready"), now, gen),
        _condition("Progressing", *prog, previous.get("Progressing"), now, gen),
        _condition(
            "Degraded",
            is_degraded,
            reason if is_degraded else "AsExpected",
            degraded_message,
            previous.get("Degraded"),
            now,
            gen,
        ),  # fmt: skip
    ]
    return {
        "phase": phase,
        "replicas": num_pods,
        "readyReplicas": num_ready,
        "updatedReplicas": num_updated,
        "selector": selector_string(meta["name"]),
        "desiredReplicas": desired,
        "observedGeneration": observed_generation,
        "endpoint": endpoint(meta["name"], meta["namespace"]),
        "servedName": (spec.get("model") or {}).get("servedName") or meta["name"],
        "conditions": conditions,
    }


def is_same_status(current: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """True when writing `new` would change none of the operator's fields."""
    current = current or {}
    if any(current.get(k) != new.get(k) for k in OWNED_FIELDS):
        return False
    have = {c.get("type"): c for c in current.get("conditions") or []}
    return all(have.get(c["type"]) == c for c in new["conditions"])
