"""What one reconcile of a model does, decided from a snapshot: `plan(snapshot, settings)` (pure).

The middle of the level-triggered core (`reconciler.py` reads the snapshot and carries the plan
out): whatever happened before, the plan only looks at the world as it is now, so every
situation is a unit test of `plan(snapshot) == expected` with no API and no sleeps.

- The spec cannot be served -> `failure` ("InvalidSpec"), status Failed, nothing applied.
- An object of a child's name is not the model's -> `failure` ("NotOwned", naming it), looked
  at again every `NOT_OWNED_RETRY_S`; one still owned by an earlier model of the same name
  (garbage collection pending) -> nothing written, looked at again soon.
- A child that is missing or differs from `render()` (`drift.first_difference`) is applied;
  nothing else is, so a second reconcile of the same world writes nothing. An owned child no
  longer rendered (the PDB at one replica) is deleted; another's object never is.
- With autoscaling on the applied Deployment has no replicas; `scale` carries spec.replicas.
- A snapshot that has not read every child (a new model's first pass: its Deployment alone,
  the write its user waits for) only applies what it read and asks to be queued again.
- Status: the operator's fields from `compute_status()`, written only when they change, and
  with this generation only once the Deployment is as rendered and its controller has seen it
  (observedGeneration never describes a rollout that has not started). While pods load, the
  model is looked at again every `pod_probe_interval_s` (their /ready tells the progress).
- Events: `Applied` when a generation's status is first written, `DriftRepaired` when a
  child of an already applied generation had to be re-applied, the failure's reason when it
  is new, and each phase change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubeinfer.operator.drift import first_difference
from kubeinfer.operator.manifests import CHILD_IDS, KIND, Manifest, child_id, child_ref, render
from kubeinfer.operator.plan_types import ChildPlan, Event, Failure, Plan, Snapshot
from kubeinfer.operator.settings import OperatorSettings
from kubeinfer.operator.spec import InferenceModelSpec, InvalidSpecError, parse_spec
from kubeinfer.operator.status import compute_status, is_same_status


def is_owned(obj: Mapping[str, Any], model: Mapping[str, Any]) -> bool:
    uid = model["metadata"].get("uid")
    return any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or [])


def ownership_problem(
    model: Mapping[str, Any], child: str, live: Mapping[str, Any] | None
) -> ChildPlan | None:
    """None when `live` (an object of the child's name) may be applied over."""
    if live is None or is_owned(live, model):
        return None
    kind = child_ref(child, model["metadata"]["name"])[0]
    meta = live["metadata"]
    ns, name = meta.get("namespace"), meta.get("name")
    owner = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), None)
    if owner and owner.get("kind") == KIND and owner.get("name") == model["metadata"]["name"]:
        return ChildPlan(
            wait=f"{kind} {ns}/{name} still belongs to an earlier InferenceModel "
            f"{owner.get('name')} (garbage collection pending)"
        )
    whose = f"{owner.get('kind')} {owner.get('name')}" if owner else "no owner"
    return ChildPlan(
        failure=Failure(
            "NotOwned",
            f"{kind} {ns}/{name} exists and is not this model's ({whose}): refusing to take "
            "it over; delete or rename it",
        )
    )


def plan_children(
    model: Mapping[str, Any],
    lives: Mapping[str, Mapping[str, Any] | None],
    settings: OperatorSettings,
) -> ChildPlan:
    """The plan for `model` given `lives` (child id -> the object of the child's name, None
    when there is none; every rendered child must be present)."""
    try:
        manifests = render(model, settings)
    except InvalidSpecError as exc:
        return ChildPlan(failure=Failure("InvalidSpec", str(exc)))
    name = model["metadata"]["name"]
    for manifest in manifests:
        child = child_id(manifest, name)
        if (problem := ownership_problem(model, child, lives.get(child))) is not None:
            return problem
    rendered = {child_id(m, name) for m in manifests}
    deletes = [
        child
        for child in CHILD_IDS
        if child not in rendered
        and (live := lives.get(child)) is not None
        and is_owned(live, model)
    ]
    return ChildPlan(applies=manifests, deletes=deletes)


def scale_target(spec: InferenceModelSpec, deployment: Mapping[str, Any] | None) -> int | None:
    """spec.replicas when autoscaling is on and the Deployment has other replicas, else None.
    No Deployment: the apply about to create it gives it the API server's default, 1."""
    if not spec.autoscaling.enabled:
        return None
    current = 1 if deployment is None else (deployment.get("spec") or {}).get("replicas")
    return spec.replicas if current != spec.replicas else None


NOT_OWNED_RETRY_S = 30.0
GC_WAIT_RETRY_S = 2.0
#: APINotInstalled: routing mode inferencePool on a cluster without the InferencePool CRD
FAILED_REASONS = ("InvalidSpec", "NotOwned", "APINotInstalled")
MISSING_API_RETRY_S = 30.0


def _generation(obj: Mapping[str, Any]) -> int:
    return int((obj.get("metadata") or {}).get("generation") or 0)


def _ready_condition(status: Mapping[str, Any]) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})


def is_generation_applied(model: Mapping[str, Any]) -> bool:
    """The model's status already describes its generation, and not as a failure."""
    status = model.get("status") or {}
    return (
        status.get("observedGeneration") == _generation(model)
        and _ready_condition(status).get("reason") not in FAILED_REASONS
    )


def is_observed(deployment: Mapping[str, Any]) -> bool:
    """The Deployment's controller has seen its latest spec (its status counts are of it)."""
    observed = (deployment.get("status") or {}).get("observedGeneration")
    return observed is not None and int(observed) >= _generation(deployment)


def _drift(desired: Manifest, live: Mapping[str, Any] | None) -> str | None:
    """Why `live` is not what was applied (None: it is)."""
    kind, name = desired["kind"], desired["metadata"]["name"]
    if live is None:
        return f"{kind} {name} was deleted"
    where = first_difference(desired, live)
    return None if where is None else f"{kind} {name} differs at {where}"


def plan(snapshot: Snapshot, settings: OperatorSettings) -> Plan:
    """What to write so that the world in `snapshot` becomes what its model asks for."""
    model, lives = snapshot.model, snapshot.children
    children = plan_children(model, lives, settings)
    if children.failure is not None:
        retry = NOT_OWNED_RETRY_S if children.failure.reason == "NotOwned" else None
        return plan_failure(snapshot, children.failure, requeue_after=retry)
    if children.wait is not None:
        return Plan(requeue_after=GC_WAIT_RETRY_S)
    name = model["metadata"]["name"]
    spec = parse_spec(model.get("spec") or {})  # render() accepted it
    ids = [child_id(m, name) for m in children.applies]
    drifts = {
        child: why
        for child, m in zip(ids, children.applies, strict=True)
        if child in lives and (why := _drift(m, lives[child]))
    }
    applies = [m for child, m in zip(ids, children.applies, strict=True) if child in drifts]
    deployment = lives.get("Deployment")
    scale = scale_target(spec, deployment) if "Deployment" in lives else None
    repairs: list[str] = []
    events: list[Event] = []
    if is_generation_applied(model):  # the generation was applied: what changed is drift
        repairs = [child_id(m, name) for m in applies]
        whys = [drifts[child] for child in repairs]
        if scale is not None and deployment is not None:
            whys.append(f"Deployment {name} has {deployment['spec'].get('replicas')} replicas")
        repairs += ["Deployment"] if scale is not None else []
        if whys:
            refs = (child_ref(child, name) for child in repairs)
            what = ", ".join(dict.fromkeys(f"{kind} {obj}" for kind, obj in refs))
            events.append(Event("Normal", "DriftRepaired", f"{'; '.join(whys)}; re-applied {what}"))
    if any(child not in lives for child in ids):  # a first pass: the rest next
        return Plan(applies=applies, scale=scale, events=events, repairs=repairs,
                    requeue_after=0.0)  # fmt: skip
    status = None
    if "Deployment" not in drifts and scale is None and is_observed(deployment or {}):
        status = _status(snapshot, deployment, failure=None)
    if status is not None and not is_generation_applied(model):
        what = ", ".join(ids)
        events.append(Event("Normal", "Applied", f"generation {_generation(model)}: {what}"))
    loading = any(p.is_running and not p.is_ready for p in snapshot.pods)
    return Plan(
        applies=applies,
        scale=scale,
        deletes=children.deletes,
        status=status,
        events=events + _phase_events(model, status),
        repairs=repairs,
        requeue_after=settings.pod_probe_interval_s if loading else None,
    )


def plan_failure(
    snapshot: Snapshot, failure: Failure, *, requeue_after: float | None = None
) -> Plan:
    """The model cannot be served as asked: status Failed naming why, an event when new."""
    model = snapshot.model
    deployment = snapshot.children.get("Deployment")
    owned = deployment if deployment is not None and is_owned(deployment, model) else None
    status = _status(snapshot, owned, failure=failure)
    ready = _ready_condition(model.get("status") or {})
    is_new = (ready.get("reason"), ready.get("message")) != (failure.reason, failure.message)
    events = [Event("Warning", failure.reason, failure.message)] if is_new else []
    return Plan(
        status=status,
        events=events + _phase_events(model, status),
        failure=failure,
        requeue_after=requeue_after,
    )


def _status(
    snapshot: Snapshot, deployment: Mapping[str, Any] | None, *, failure: Failure | None
) -> dict[str, Any] | None:
    """The operator's status for `snapshot`, None when the model's already says it."""
    model = snapshot.model
    spec = model.get("spec") or {}
    router = None
    if (spec.get("routing") or {}).get("mode", "router") == "router":
        live = snapshot.children.get("RouterDeployment")
        router = live if live is not None and is_owned(live, model) else None
    status = compute_status(
        model,
        deployment,
        snapshot.pods,
        failure=failure.message if failure else None,
        failure_reason=failure.reason if failure else "InvalidSpec",
        observed_generation=_generation(model),
        now=snapshot.now,
        router=router,
    )
    if ((model.get("spec") or {}).get("autoscaling") or {}).get("enabled"):
        del status["desiredReplicas"]  # the autoscaler's field while it runs
    return None if is_same_status(model.get("status"), status) else status


def _phase_events(model: Mapping[str, Any], status: Mapping[str, Any] | None) -> list[Event]:
    if status is None or (model.get("status") or {}).get("phase") == status["phase"]:
        return []
    kind = "Warning" if status["phase"] in ("Failed", "Degraded") else "Normal"
    return [Event(kind, status["phase"], status["conditions"][0]["message"])]
