"""plan_children() and scale_target(): each situation a snapshot, each answer a plan."""

from __future__ import annotations

from typing import Any

import pytest

from kubeinfer.operator.manifests import labels
from kubeinfer.operator.plan import ChildPlan, Failure, plan_children, scale_target
from kubeinfer.operator.settings import OperatorSettings
from kubeinfer.operator.spec import parse_spec
from tests.operator.conftest import make_model

SETTINGS = OperatorSettings()
MODEL = make_model()
OURS = {"kind": "InferenceModel", "name": "smollm2", "uid": "1234-abcd", "controller": True}
EARLIER = {**OURS, "uid": "old-uid"}


def live(kind: str, *owners: dict[str, Any], replicas: int | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "kind": kind,
        "metadata": {
            "name": "smollm2",
            "namespace": "models",
            "labels": labels("smollm2"),
            "ownerReferences": list(owners),
        },  # fmt: skip
        "spec": {},
    }
    if replicas is not None:
        obj["spec"]["replicas"] = replicas
    return obj


def kinds(plan: ChildPlan) -> list[str]:
    return [m["kind"] for m in plan.applies]


def test_a_new_model_applies_its_deployment_first() -> None:
    plan = plan_children(MODEL, {"Deployment": None, "Service": None}, SETTINGS)
    assert kinds(plan) == ["Deployment", "Service"] and plan.deletes == []
    assert plan.failure is None and plan.wait is None


def test_above_one_replica_a_pdb_is_applied() -> None:
    model = make_model({"model": {"uri": "pvc://w"}, "replicas": 3})
    assert kinds(plan_children(model, {}, SETTINGS)) == ["Deployment", "Service",
                                                          "PodDisruptionBudget"]  # fmt: skip


def test_an_owned_pdb_no_longer_wanted_is_deleted() -> None:
    lives = {"Deployment": live("Deployment", OURS), "PodDisruptionBudget": live("P", OURS)}
    assert plan_children(MODEL, lives, SETTINGS).deletes == ["PodDisruptionBudget"]


def test_another_objects_pdb_is_never_deleted() -> None:
    lives = {"PodDisruptionBudget": live("PodDisruptionBudget")}  # our labels, no owner
    assert plan_children(MODEL, lives, SETTINGS).deletes == []


@pytest.mark.parametrize("kind", ["Deployment", "Service"])
def test_another_object_of_a_childs_name_fails_the_model(kind: str) -> None:
    theirs = {"kind": "Thing", "name": "x", "uid": "u", "controller": True}
    plan = plan_children(MODEL, {kind: live(kind, theirs)}, SETTINGS)
    assert plan.applies == [] and plan.failure is not None
    assert plan.failure.reason == "NotOwned"
    assert f"{kind} models/smollm2 exists and is not this model's (Thing x)" in plan.failure.message


def test_an_earlier_models_leftover_is_waited_for() -> None:
    plan = plan_children(MODEL, {"Deployment": live("Deployment", EARLIER)}, SETTINGS)
    assert plan.applies == [] and plan.failure is None
    assert plan.wait is not None and "garbage collection pending" in plan.wait


def test_an_unservable_spec_fails_before_anything_is_read() -> None:
    model = make_model({"model": {"uri": "hostpath:///data/m"}})
    plan = plan_children(model, {}, SETTINGS)  # hostpath off by default
    assert plan.failure == Failure("InvalidSpec", plan.failure.message if plan.failure else "")
    assert plan.failure is not None and "hostpath://" in plan.failure.message


@pytest.mark.parametrize(
    ("autoscaling", "replicas", "live_replicas", "expected"),
    [
        (True, 3, 1, 3),
        (True, 3, 3, None),
        (True, 3, None, None),  # no Deployment yet: the apply creates it
        (False, 3, 1, None),  # the applied Deployment carries replicas itself
    ],
)
def test_scale_target(
    autoscaling: bool, replicas: int, live_replicas: int | None, expected: int | None
) -> None:
    spec = parse_spec(
        {"model": {"uri": "pvc://w"}, "replicas": replicas, "autoscaling": {"enabled": autoscaling}}
    )
    deployment = None if live_replicas is None else live("Deployment", OURS, replicas=live_replicas)
    assert scale_target(spec, deployment) == expected
