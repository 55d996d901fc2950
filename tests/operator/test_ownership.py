"""Never adopt: an object of a child's name that the model does not own fails the model with a
reason naming it and is never written or deleted; an earlier model's leftovers are waited for;
pods count for a model only through its own Deployment's ReplicaSets. Fake API, no cluster."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from kubeinfer.operator.manifests import KIND, labels
from kubeinfer.operator.store import Store
from tests.operator.conftest import make_model
from tests.operator.test_reconciler import KEY, converge, setup


def foreign(kind: str, owner: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": kind,
        "metadata": {
            "name": "smollm2",
            "namespace": "models",
            "uid": f"foreign-{kind}",
            "ownerReferences": [owner] if owner else [],
            **meta,
        },
        "spec": {"selector": {"app": "theirs"}},
    }


@pytest.mark.parametrize("kind", ["Service", "Deployment"])
def test_an_unlabelled_foreign_object_is_read_fails_the_model_and_is_left_alone(
    kind: str,
) -> None:
    """The watches only show labelled objects: each rendered name they do not show is read
    before anything is applied over it."""
    r, api = setup()
    theirs = foreign(kind)
    api.objects[(kind, *KEY)] = copy.deepcopy(theirs)
    converge(r, max_passes=2)
    assert api.objects[(kind, *KEY)] == theirs and kind not in api.calls
    assert not any(c.startswith("delete") for c in api.calls)
    status = api.objects[(KIND, *KEY)]["status"]
    assert status["phase"] == "Failed" and status["conditions"][0]["reason"] == "NotOwned"
    assert f"{kind} models/smollm2 exists" in status["conditions"][0]["message"]


def test_an_earlier_models_leftover_is_a_transient_wait() -> None:
    r, api = setup(make_model({"model": {"uri": "pvc://weights"}, "routing": {"mode": "service"}}))
    earlier = {"apiVersion": "kubeinfer.dev/v1alpha1", "kind": "InferenceModel",
               "name": "smollm2", "uid": "old-uid", "controller": True}  # fmt: skip
    api.objects[("Deployment", *KEY)] = foreign("Deployment", earlier)
    requeue = asyncio.run(r.reconcile(KEY))
    assert requeue is not None and api.calls == ["read Deployment", "read Service"]  # no write


def test_a_foreign_object_with_our_labels_is_not_an_owned_child() -> None:
    store = Store()
    store.observe(KIND, "ADDED", make_model())
    store.observe("Service", "ADDED", foreign("Service", labels=labels("smollm2")))
    assert store.child("Service", KEY) is not None  # for the ownership check
    assert store.owned_child("Service", KEY) is None


def _replicaset(name: str, uid: str, deployment_uid: str) -> dict[str, Any]:
    return {
        "kind": "ReplicaSet",
        "metadata": {
            "name": name,
            "namespace": "models",
            "uid": uid,
            "labels": labels("smollm2"),
            "ownerReferences": [{"kind": "Deployment", "uid": deployment_uid, "controller": True}],
        },
    }


def _pod(name: str, rs_uid: str | None) -> dict[str, Any]:
    refs = [{"kind": "ReplicaSet", "uid": rs_uid, "controller": True}] if rs_uid else []
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "models",
            "labels": labels("smollm2"),
            "ownerReferences": refs,
        },  # fmt: skip
        "status": {
            "phase": "Running",
            "podIP": "127.1.0.5",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def test_pods_count_only_through_the_models_own_replicasets() -> None:
    """A pod that copies the model's labels (no owner, or another Deployment's ReplicaSet) is
    neither counted nor probed."""
    store = Store()
    model = make_model()
    store.observe(KIND, "ADDED", model)
    dep = foreign("Deployment", {"kind": KIND, "uid": model["metadata"]["uid"]}, uid="dep-uid")
    store.observe("Deployment", "ADDED", dep)
    assert (
        store.observe("ReplicaSet", "ADDED", _replicaset("smollm2-abc", "rs-1", "dep-uid")) == KEY
    )
    store.observe("ReplicaSet", "ADDED", _replicaset("impostor-abc", "rs-2", "other-dep"))
    assert store.observe("Pod", "ADDED", _pod("smollm2-abc-1", "rs-1")) == KEY
    store.observe("Pod", "ADDED", _pod("copycat", None))
    store.observe("Pod", "ADDED", _pod("impostor-abc-1", "rs-2"))
    assert set(store.owned_pods(KEY)) == {"smollm2-abc-1"}
    store.observe("ReplicaSet", "DELETED", _replicaset("smollm2-abc", "rs-1", "dep-uid"))
    assert store.owned_pods(KEY) == {}
