"""The router a model gets (spec.routing.mode router, the default): render() and plan(), without
a cluster."""

from __future__ import annotations

from typing import Any

import pytest

from kubeinfer.operator.manifests import (
    CHILD_IDS,
    child_id,
    child_ref,
    render,
    router_selector_string,
    selector_string,
)
from kubeinfer.operator.plan import plan_children
from kubeinfer.operator.settings import OperatorSettings
from kubeinfer.operator.spec import InvalidSpecError, parse_spec
from tests.operator.conftest import example_model, make_model

CONFIG = OperatorSettings(
    router_image="kubeinfer/operator:test", allow_hostpath=True, hostpath_prefixes=["/srv"]
)
OURS = {"kind": "InferenceModel", "name": "smollm2", "uid": "1234-abcd", "controller": True}


def children(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {child_id(m, model["metadata"]["name"]): m for m in render(model, CONFIG)}


def arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_router_mode_is_the_default_and_renders_its_four_objects() -> None:
    out = children(make_model())
    router = {k: v for k, v in out.items() if k.startswith("Router")}
    assert [(m["kind"], m["metadata"]["name"]) for m in router.values()] == [
        ("ServiceAccount", "smollm2-router"),
        ("Role", "smollm2-router"),
        ("RoleBinding", "smollm2-router"),
        ("Deployment", "smollm2-router"),
    ]
    for m in router.values():
        assert m["metadata"]["namespace"] == "models"
        assert m["metadata"]["ownerReferences"] == [
            {**OURS, "apiVersion": "kubeinfer.dev/v1alpha1", "blockOwnerDeletion": True}
        ]
        assert m["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kubeinfer"
        assert m["metadata"]["labels"]["app.kubernetes.io/instance"] == "smollm2"


def test_the_router_may_only_read_pods_in_its_namespace() -> None:
    out = children(make_model())
    assert out["RouterRole"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    binding = out["RouterRoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "smollm2-router"
    }  # fmt: skip
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "smollm2-router", "namespace": "models"}
    ]


def test_the_router_deployment_selects_the_models_runtime_pods_and_holds_no_gpu() -> None:
    model = example_model("/srv/models/smollm2-135m", namespace="ml")
    model["metadata"]["uid"] = "u-1"
    model["spec"]["routing"] = {"replicas": 2, "maxHeldRequests": 7, "maxHoldSeconds": 40}
    dep = children(model)["RouterDeployment"]
    assert dep["spec"]["replicas"] == 2
    selector = dep["spec"]["selector"]["matchLabels"]
    pairs = sorted(selector.items())
    assert router_selector_string("smollm2") == ",".join(f"{k}={v}" for k, v in pairs)
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "smollm2-router"
    assert pod["automountServiceAccountToken"] is True
    (c,) = pod["containers"]
    assert c["image"] == "kubeinfer/operator:test"
    assert c["command"] == ["kubeinfer", "router"]
    args = c["args"]
    assert arg(args, "--selector") == selector_string("smollm2")
    assert arg(args, "--namespace") == "ml"
    assert arg(args, "--host") == "$(POD_IP)" and arg(args, "--port") == "8000"
    assert arg(args, "--pod-port") == "8000" and arg(args, "--model-name") == "smollm2"
    assert arg(args, "--max-held-requests") == "7" and arg(args, "--max-hold-s") == "40"
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert set(c["resources"]["requests"]) == {"cpu", "memory"}  # no accelerator
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert "tolerations" not in pod and "nodeSelector" not in pod
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    # the router's pods never match the runtime Deployment's selector, nor the reverse
    runtime = children(model)["Deployment"]
    router_labels = dep["spec"]["template"]["metadata"]["labels"]
    runtime_sel = runtime["spec"]["selector"]["matchLabels"]
    assert not runtime_sel.items() <= router_labels.items()
    runtime_labels = runtime["spec"]["template"]["metadata"]["labels"]
    assert not dep["spec"]["selector"]["matchLabels"].items() <= runtime_labels.items()


def test_the_models_service_selects_the_router_pods_and_keeps_its_name() -> None:
    routed = children(make_model())["Service"]
    assert routed["metadata"]["name"] == "smollm2"  # status.endpoint is the same in every mode
    assert routed["spec"]["selector"] == {
        "app.kubernetes.io/name": "kubeinfer-router", "app.kubernetes.io/instance": "smollm2"
    }  # fmt: skip
    plain = children(make_model({"model": {"uri": "pvc://w"}, "routing": {"mode": "service"}}))
    assert plain["Service"]["spec"]["selector"]["app.kubernetes.io/name"] == "kubeinfer-runtime"
    assert not any(k.startswith("Router") for k in plain)


@pytest.mark.parametrize(
    "routing",
    [{"mode": "gateway"}, {"replicas": 0}, {"maxHeldRequests": -1}, {"maxHoldSeconds": 0}],
)
def test_an_invalid_routing_spec_is_refused(routing: dict[str, Any]) -> None:
    with pytest.raises(InvalidSpecError, match="spec.routing"):
        parse_spec({"model": {"uri": "pvc://w"}, "routing": routing})


def test_child_ids_name_each_object_once() -> None:
    refs = [child_ref(c, "m") for c in CHILD_IDS]
    assert len(set(refs)) == len(refs)
    for c in CHILD_IDS:
        kind, name = child_ref(c, "m")
        assert child_id({"kind": kind, "metadata": {"name": name}}, "m") == c


def live(kind: str, name: str, *owners: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": kind,
        "metadata": {"name": name, "namespace": "models", "ownerReferences": list(owners)},
        "spec": {},
    }


def test_someone_elses_router_named_object_fails_the_model_and_is_never_adopted() -> None:
    """A model named `smollm2-router` owns a Deployment of that name: `smollm2` refuses to
    take it over (and says whose it is) rather than apply its router over it."""
    theirs = {"kind": "InferenceModel", "name": "smollm2-router", "uid": "u-2", "controller": True}
    lives = {"RouterDeployment": live("Deployment", "smollm2-router", theirs)}
    plan = plan_children(make_model(), lives, CONFIG)
    assert plan.applies == [] and plan.failure is not None
    assert plan.failure.reason == "NotOwned"
    assert "Deployment models/smollm2-router exists and is not this model's" in (
        plan.failure.message
    )


def test_an_owned_router_is_deleted_in_service_mode_but_never_anothers() -> None:
    model = make_model({"model": {"uri": "pvc://w"}, "routing": {"mode": "service"}})
    mine = {rid: live(*child_ref(rid, "smollm2"), OURS) for rid in CHILD_IDS
            if rid.startswith("Router")}  # fmt: skip
    plan = plan_children(model, mine, CONFIG)
    assert sorted(plan.deletes) == sorted(mine)
    theirs = {rid: live(*child_ref(rid, "smollm2")) for rid in mine}
    assert plan_children(model, theirs, CONFIG).deletes == []


@pytest.mark.parametrize("mode", ["service", "inferencePool"])
def test_scale_from_zero_needs_the_router(mode: str) -> None:
    """Only the router holds requests at zero replicas and reports them to the autoscaler."""
    spec = {"model": {"uri": "pvc://w"}, "routing": {"mode": mode},
            "autoscaling": {"enabled": True, "minReplicas": 0}}  # fmt: skip
    with pytest.raises(InvalidSpecError, match="minReplicas 0 needs spec.routing.mode router"):
        parse_spec(spec)
    parse_spec({**spec, "routing": {"mode": "router"}})


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ({"replicas": 0}, 0),  # paused: nothing to route to, nothing scales it from zero
        ({"replicas": 0, "routing": {"replicas": 3}}, 0),
        ({"replicas": 2, "routing": {"replicas": 3}}, 3),
        ({"replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 0}}, 1),
    ],
)
def test_a_paused_model_runs_no_router_pod(spec: dict[str, Any], want: int) -> None:
    """A bug: 500 paused models (bench/operator_scale.py) asked for 500 router pods."""
    model = example_model("/srv/models/smollm2-135m")
    model["metadata"]["uid"] = "u-1"
    model["spec"].update(spec)
    assert children(model)["RouterDeployment"]["spec"]["replicas"] == want
