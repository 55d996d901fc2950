"""plan(), plan_children() and scale_target(): each situation a snapshot, each answer a plan.
No API, no clock, no sleeps."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kubeinfer.operator.manifests import child_id, labels, render
from kubeinfer.operator.plan import (
    NOT_OWNED_RETRY_S,
    ChildPlan,
    Failure,
    plan,
    plan_children,
    plan_failure,
    scale_target,
)
from kubeinfer.operator.plan_types import Plan, Snapshot
from kubeinfer.operator.settings import OperatorSettings
from kubeinfer.operator.spec import parse_spec
from kubeinfer.operator.status import PodView
from tests.operator.conftest import make_model as make_any_model


def make_model(spec: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    """A model in routing mode `service`: these tests are about the runtime's children, the
    same in every mode (the router's: the end of this file)."""
    model = make_any_model(spec, **meta)
    model["spec"].setdefault("routing", {"mode": "service"})
    return model


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
        (True, 3, None, 3),  # no Deployment yet: the apply creates it with 1
        (True, 1, None, None),
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


# --- plan(snapshot): one reconcile's writes, for each situation the old races came from -------


def applied(manifest: dict[str, Any], *, generation: int = 1, observed: int | None = 1,
            **status: int) -> dict[str, Any]:  # fmt: skip
    """`manifest` as the API server holds it once applied (and, for a Deployment, as far as
    its controller has seen it: `observed`)."""
    obj = copy.deepcopy(manifest)
    obj["metadata"] |= {"uid": f"uid-{manifest['kind']}", "generation": generation}
    if manifest["kind"] == "Deployment":
        obj["spec"].setdefault("replicas", 1)
        obj["status"] = {**status, **({} if observed is None else {"observedGeneration": observed})}
    return obj


def world(model: dict[str, Any], **status: int) -> dict[str, dict[str, Any] | None]:
    """Every child of `model` as rendered and applied."""
    name = model["metadata"]["name"]
    return {child_id(m, name): applied(m, **status) for m in render(model, SETTINGS)}


def converged(model: dict[str, Any], lives: dict[str, Any]) -> dict[str, Any]:
    """`model` with the status a reconcile of `lives` writes (as after that write)."""
    status = plan(Snapshot(model, lives), SETTINGS).status
    assert status is not None
    return {**model, "status": status}


def reasons(p: Plan) -> list[str]:
    return [e.reason for e in p.events]


def test_a_new_models_first_pass_applies_its_deployment_alone() -> None:
    """Only the Deployment's name was read (the write its user waits for); the rest comes in
    the next, non-urgent pass."""
    p = plan(Snapshot(MODEL, {"Deployment": None}), SETTINGS)
    assert kinds_of(p) == ["Deployment"] and p.status is None and p.events == []
    assert p.requeue_after == 0.0


def test_the_second_pass_applies_the_rest_and_the_first_status() -> None:
    lives = world(MODEL) | {"Service": None}
    p = plan(Snapshot(MODEL, lives), SETTINGS)
    assert kinds_of(p) == ["Service"] and p.deletes == [] and p.scale is None
    assert p.status is not None and p.status["observedGeneration"] == 1
    assert p.status["phase"] == "Pending"
    assert reasons(p) == ["Applied", "Pending"]


def test_a_converged_world_plans_nothing() -> None:
    """Idempotent: once the status is written, the same world writes nothing (no status
    write storm from the events of the operator's own writes)."""
    lives = world(MODEL, replicas=1, readyReplicas=1, updatedReplicas=1)
    model = converged(MODEL, lives)
    assert model["status"]["phase"] == "Ready"
    assert plan(Snapshot(model, lives, now="later"), SETTINGS) == Plan()


def test_a_spec_change_during_a_status_write_is_applied_and_only_then_reported() -> None:
    """CI twice: after a maxNumSeqs change the status read Ready with the new pod counts and
    the old observedGeneration, then with the new one before the rollout began. Whatever the
    order of replies, the plan looks at the model as it is now: generation 2, status still of
    generation 1, Deployment still rendered from generation 1."""
    old_lives = world(MODEL, replicas=1, readyReplicas=1, updatedReplicas=1)
    changed = converged(MODEL, old_lives)
    changed["spec"] = {"model": {"uri": "pvc://weights"}, "runtime": {"maxNumSeqs": 8},
                       "routing": {"mode": "service"}}  # fmt: skip
    changed["metadata"] = {**changed["metadata"], "generation": 2}
    p = plan(Snapshot(changed, old_lives), SETTINGS)
    assert kinds_of(p) == ["Deployment"] and p.status is None and p.repairs == []
    args = p.applies[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "8"
    # applied, but its controller has not seen it yet: its counts are the old template's
    new_dep = applied(p.applies[0], generation=2, observed=1, replicas=1, readyReplicas=1,
                      updatedReplicas=1)  # fmt: skip
    lives = old_lives | {"Deployment": new_dep}
    assert plan(Snapshot(changed, lives), SETTINGS) == Plan()
    new_dep["status"] = {"observedGeneration": 2, "replicas": 2, "readyReplicas": 1,
                         "updatedReplicas": 1}  # fmt: skip
    p = plan(Snapshot(changed, lives), SETTINGS)
    assert p.applies == [] and p.status is not None
    assert p.status["observedGeneration"] == 2 and p.status["phase"] == "Ready"
    progressing = p.status["conditions"][1]
    assert progressing["reason"] == "RolloutInProgress", progressing
    assert reasons(p) == ["Applied"]


def test_a_deployment_deleted_during_the_first_apply_is_applied_again() -> None:
    """The old first apply waited its turn for the Service after writing the Deployment; a
    Deployment deleted then was never restored. Now the next snapshot just lacks it."""
    lives = world(MODEL) | {"Deployment": None}
    p = plan(Snapshot(MODEL, lives), SETTINGS)
    assert kinds_of(p) == ["Deployment"] and p.status is None
    assert p.repairs == []  # the generation was never applied: not drift


def test_drift_of_an_applied_generation_is_repaired_with_an_event() -> None:
    lives = world(MODEL, replicas=1, readyReplicas=1, updatedReplicas=1)
    model = converged(MODEL, lives)
    edited = copy.deepcopy(lives["Deployment"])
    assert edited is not None
    edited["spec"]["template"]["spec"]["containers"][0]["args"][1] = "/elsewhere"
    p = plan(Snapshot(model, lives | {"Deployment": edited, "Service": None}), SETTINGS)
    assert kinds_of(p) == ["Deployment", "Service"] and p.repairs == ["Deployment", "Service"]
    assert p.status is None  # until the Deployment is back as rendered
    (event,) = p.events
    assert event.reason == "DriftRepaired"
    assert "Deployment smollm2 differs at .spec.template.spec.containers[0].args" in event.message
    assert "Service smollm2 was deleted" in event.message


def test_drift_seen_while_a_repair_runs_is_repaired_by_the_next_pass() -> None:
    """The cluster test deleted the Deployment, then edited the recreated one's args while the
    repair still wrote the Service: that edit's repair was dropped because one ran. Now each
    pass plans from what it sees: the recreated, edited Deployment is applied again."""
    lives = world(MODEL, replicas=1, readyReplicas=1, updatedReplicas=1)
    model = converged(MODEL, lives)
    assert kinds_of(plan(Snapshot(model, lives | {"Deployment": None}), SETTINGS)) == ["Deployment"]
    recreated = copy.deepcopy(lives["Deployment"])
    assert recreated is not None
    recreated["spec"]["template"]["spec"]["containers"][0]["args"][1] = "/elsewhere"
    p = plan(Snapshot(model, lives | {"Deployment": recreated}), SETTINGS)
    assert kinds_of(p) == ["Deployment"] and p.repairs == ["Deployment"]


def test_a_pdb_no_longer_wanted_is_deleted_and_its_absence_is_not_drift() -> None:
    three = make_model({"model": {"uri": "pvc://w"}, "replicas": 3})
    lives = world(three)
    one = converged(three, lives)
    one["spec"] = {"model": {"uri": "pvc://w"}, "replicas": 1, "routing": {"mode": "service"}}
    one["metadata"] = {**one["metadata"], "generation": 2}
    p = plan(Snapshot(one, lives), SETTINGS)
    assert (
        p.deletes == ["PodDisruptionBudget"]
        and p.repairs == []
        and "DriftRepaired" not in reasons(p)
    )
    # the PDB gone, the Deployment (replicas 1) as rendered: nothing to repair
    after = {k: v for k, v in world(one).items()}
    assert plan(Snapshot(converged(one, after), after), SETTINGS) == Plan()


def test_another_objects_service_fails_the_model_once() -> None:
    theirs = {"kind": "Thing", "name": "x", "uid": "u", "controller": True}
    lives = world(MODEL) | {"Service": live("Service", theirs)}
    p = plan(Snapshot(MODEL, lives), SETTINGS)
    assert p.applies == [] and p.deletes == [] and p.requeue_after == NOT_OWNED_RETRY_S
    assert p.failure is not None and p.failure.reason == "NotOwned"
    assert p.status is not None and p.status["phase"] == "Failed"
    assert p.status["conditions"][0]["reason"] == "NotOwned"
    assert reasons(p) == ["NotOwned", "Failed"]
    # the status says so already: looked at again, nothing is written
    failed = {**MODEL, "status": p.status}
    again = plan(Snapshot(failed, lives), SETTINGS)
    assert again.num_writes == 0 and again.requeue_after == NOT_OWNED_RETRY_S
    # the object gone: applied, and the status is the model's own again
    p = plan(Snapshot(failed, lives | {"Service": None}), SETTINGS)
    assert kinds_of(p) == ["Service"] and p.status is not None and p.status["phase"] == "Pending"
    assert p.repairs == [] and reasons(p) == ["Applied", "Pending"]


def test_a_foreign_deployment_is_never_counted_in_the_failed_status() -> None:
    theirs = live("Deployment", {"kind": "Thing", "name": "x", "uid": "u", "controller": True})
    theirs["status"] = {"replicas": 5, "readyReplicas": 5}
    p = plan(Snapshot(MODEL, {"Deployment": theirs}), SETTINGS)
    assert p.status is not None and p.status["readyReplicas"] == 0 and p.applies == []


def test_an_earlier_models_leftover_is_waited_for_without_writes() -> None:
    p = plan(Snapshot(MODEL, {"Deployment": live("Deployment", EARLIER)}), SETTINGS)
    assert p.num_writes == 0 and p.requeue_after is not None and p.failure is None


def test_an_unservable_spec_is_failed_with_its_reason() -> None:
    model = make_model({"model": {"uri": "hostpath:///data/m"}})
    p = plan(Snapshot(model, {"Deployment": None}), SETTINGS)
    assert p.applies == [] and p.failure is not None and p.failure.reason == "InvalidSpec"
    assert p.status is not None and "hostpath://" in p.status["conditions"][0]["message"]


def test_a_rejected_apply_fails_the_model() -> None:
    p = plan_failure(Snapshot(MODEL, world(MODEL)), Failure("InvalidSpec", "HTTP 422: tolerations"))
    assert p.status is not None and p.status["phase"] == "Failed" and p.applies == []
    assert reasons(p) == ["InvalidSpec", "Failed"]


def test_autoscaled_replicas_go_through_scale_and_desired_replicas_is_left_alone() -> None:
    model = make_model({"model": {"uri": "pvc://w"}, "replicas": 2,
                        "autoscaling": {"enabled": True}})  # fmt: skip
    first = plan(Snapshot(model, {"Deployment": None}), SETTINGS)
    assert kinds_of(first) == ["Deployment"] and first.scale == 2  # created with 1: scaled after
    lives = world(model)
    assert lives["Deployment"] is not None and "replicas" not in first.applies[0]["spec"]
    p = plan(Snapshot(model, lives), SETTINGS)  # applied() defaulted replicas to 1
    assert p.applies == [] and p.scale == 2 and p.status is None
    lives["Deployment"]["spec"]["replicas"] = 2
    p = plan(Snapshot(model, lives), SETTINGS)
    assert p.scale is None and p.status is not None and "desiredReplicas" not in p.status


def test_a_status_change_is_written_and_loading_pods_are_looked_at_again() -> None:
    lives = world(MODEL, replicas=1)
    model = converged(MODEL, lives)
    loading = PodView("smollm2-a-1", is_running=True, is_ready=False, restart_count=0,
                      problem="", progress="loaded 10 of 20 MB")  # fmt: skip
    p = plan(Snapshot(model, lives, pods=[loading]), SETTINGS)
    assert p.status is not None and p.status["phase"] == "Loading"
    assert "loaded 10 of 20 MB" in p.status["conditions"][0]["message"]
    assert p.requeue_after == SETTINGS.pod_probe_interval_s
    ready = world(MODEL, replicas=1, readyReplicas=1, updatedReplicas=1)
    done = PodView("smollm2-a-1", is_running=True, is_ready=True, restart_count=0, problem="")
    p = plan(Snapshot({**model, "status": p.status}, ready, pods=[done]), SETTINGS)
    assert p.status is not None and p.status["readyReplicas"] == 1 and p.requeue_after is None
    assert reasons(p) == ["Ready"]


def kinds_of(p: Plan) -> list[str]:
    return [m["kind"] for m in p.applies]
