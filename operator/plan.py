"""What one apply of a model does, decided from a snapshot: `plan_children(...)` (pure).

The first piece of the level-triggered core (issue #17): the reconciler reads a snapshot (the
model, and each child name as the watch or a GET shows it) and this module says what to do
with it, so every situation is a unit test of `plan == expected` with no API and no sleeps:

- the spec cannot be served -> `failure` ("InvalidSpec", the reason), nothing written;
- an object of a child's name is not the model's -> `failure` ("NotOwned", naming it), or,
  when an earlier model of the same name still owns it (garbage collection pending), `wait`;
- otherwise `applies` (the Deployment first: it is a new model's urgent write) and `deletes`
  (owned children no longer rendered, e.g. the PDB at one replica; never another's object).

`scale_target` says whether the Deployment's replicas need the scale subresource (autoscaling
on: the applied Deployment carries none).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubeinfer.operator.manifests import KIND, Manifest, render
from kubeinfer.operator.settings import OperatorSettings
from kubeinfer.operator.spec import InferenceModelSpec, InvalidSpecError

CHILD_KINDS = ("Deployment", "Service", "PodDisruptionBudget")


@dataclass(slots=True, frozen=True)
class Failure:
    reason: str  # the Ready condition's reason: InvalidSpec | NotOwned
    message: str


@dataclass(slots=True, frozen=True)
class ChildPlan:
    applies: list[Manifest] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)  # kinds
    failure: Failure | None = None
    wait: str | None = None  # transient: try again soon


def is_owned(obj: Mapping[str, Any], model: Mapping[str, Any]) -> bool:
    uid = model["metadata"].get("uid")
    return any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or [])


def ownership_problem(
    model: Mapping[str, Any], kind: str, live: Mapping[str, Any] | None
) -> ChildPlan | None:
    """None when `live` (an object of the child's name) may be applied over."""
    if live is None or is_owned(live, model):
        return None
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
    """The plan for `model` given `lives` (kind -> the object of the child's name, None when
    there is none; every rendered kind must be present)."""
    try:
        manifests = render(model, settings)
    except InvalidSpecError as exc:
        return ChildPlan(failure=Failure("InvalidSpec", str(exc)))
    for manifest in manifests:
        kind = manifest["kind"]
        if (problem := ownership_problem(model, kind, lives.get(kind))) is not None:
            return problem
    rendered = {m["kind"] for m in manifests}
    deletes = [
        kind
        for kind in CHILD_KINDS
        if kind not in rendered and (live := lives.get(kind)) is not None and is_owned(live, model)
    ]
    return ChildPlan(applies=manifests, deletes=deletes)


def scale_target(spec: InferenceModelSpec, deployment: Mapping[str, Any] | None) -> int | None:
    """spec.replicas when autoscaling is on and the Deployment has other replicas, else None
    (None too when there is no Deployment: the next apply creates it)."""
    if not spec.autoscaling.enabled or deployment is None:
        return None
    current = (deployment.get("spec") or {}).get("replicas")
    return spec.replicas if current != spec.replicas else None
