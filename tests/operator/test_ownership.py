"""Never adopt: an object of a child's name that the model does not own fails the model with a
reason naming it and is never written or deleted; an earlier model's leftovers are waited for;
pods count for a model only through its own Deployment's ReplicaSets. Fake API, no cluster."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from kubeinfer.operator.kube import TransientApiError
from kubeinfer.operator.manifests import labels
from kubeinfer.operator.reconciler import NotOwnedError
from tests.operator.conftest import make_model
from tests.operator.test_reconciler import applied_reconciler, reconciler, settle


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
def test_a_foreign_object_fails_the_model_and_is_left_alone(kind: str) -> None:
    async def run() -> None:
        r, api = reconciler()
        theirs = foreign(kind)
        api.objects[(kind, "models", "smollm2")] = copy.deepcopy(theirs)
        model = make_model()
        r.observe_model("ADDED", model)
        with pytest.raises(NotOwnedError, match=f"{kind} models/smollm2 exists"):
            await r.apply(model)
        # a new model's Deployment is its urgent write; the Service name is read with the
        # Service's turn, after it: the model's own new Deployment may exist, never theirs
        assert api.calls.count(kind) == 0 and api.deleted == []
        assert api.objects[(kind, "models", "smollm2")] == theirs
        await settle()
        status = api.statuses[-1]
        assert status["phase"] == "Failed"
        assert f"{kind} models/smollm2" in json_text(status)
        assert "event" in api.calls and status["conditions"][0]["reason"] == "NotOwned"
        await r.close()

    asyncio.run(run())


def json_text(obj: Any) -> str:
    import json

    return json.dumps(obj)


def test_a_foreign_object_with_our_labels_is_not_adopted_either() -> None:
    """The watches see labelled objects: labels copied onto someone's Service do not make it
    the model's."""

    async def run() -> None:
        r, api = reconciler()
        theirs = foreign("Service", labels=labels("smollm2"))
        api.objects[("Service", "models", "smollm2")] = theirs
        r.observe_child("ADDED", theirs)
        model = make_model()
        r.observe_model("ADDED", model)
        with pytest.raises(NotOwnedError):
            await r.apply(model)
        assert api.num_applies == 0
        await r.close()

    asyncio.run(run())


def test_the_model_recovers_once_the_foreign_object_is_gone() -> None:
    async def run() -> None:
        r, api = reconciler()
        api.objects[("Service", "models", "smollm2")] = foreign("Service")
        model = make_model()
        r.observe_model("ADDED", model)
        with pytest.raises(NotOwnedError):
            await r.apply(model)
        del api.objects[("Service", "models", "smollm2")]
        await r.apply(model)  # kopf's retry
        assert {k[0] for k in api.objects} == {"Deployment", "Service"}
        await settle()
        assert api.statuses[-1]["phase"] != "Failed"
        await r.close()

    asyncio.run(run())


def test_an_earlier_models_leftover_is_a_transient_wait() -> None:
    async def run() -> None:
        r, api = reconciler()
        earlier = {"apiVersion": "kubeinfer.dev/v1alpha1", "kind": "InferenceModel",
                   "name": "smollm2", "uid": "old-uid", "controller": True}  # fmt: skip
        api.objects[("Deployment", "models", "smollm2")] = foreign("Deployment", earlier)
        model = make_model()
        r.observe_model("ADDED", model)
        with pytest.raises(TransientApiError, match="garbage collection pending"):
            await r.apply(model)
        assert api.num_applies == 0
        await r.close()

    asyncio.run(run())


def test_a_foreign_pdb_is_never_deleted() -> None:
    async def run() -> None:
        r, api = await applied_reconciler()  # one replica: no PDB wanted
        theirs = foreign("PodDisruptionBudget", labels=labels("smollm2"))
        r.observe_child("ADDED", theirs)
        await r.apply(make_model())
        assert api.deleted == []
        await r.close()

    asyncio.run(run())


def test_a_new_model_reads_each_unknown_name_before_applying_over_it() -> None:
    """Only the Deployment's read is on a new model's critical path (bench/operator_scale.py:
    both reads first doubled the p50); the Service's waits with the Service's write."""

    async def run() -> None:
        r, api = reconciler()
        api_get = api.get

        async def get(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
            api.calls.append(f"read {kind}")
            return await api_get(kind, namespace, name)

        api.get = get  # type: ignore[method-assign]
        model = make_model()
        r.observe_model("ADDED", model)
        await r.apply(model)
        assert api.calls[:4] == ["read Deployment", "Deployment", "read Service", "Service"]
        await r.close()

    asyncio.run(run())


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

    async def run() -> None:
        r, api = await applied_reconciler()
        dep = copy.deepcopy(api.objects[("Deployment", "models", "smollm2")])
        dep["metadata"]["uid"] = "dep-uid"
        r.observe_child("MODIFIED", dep)
        r.observe_replicaset("ADDED", _replicaset("smollm2-abc", "rs-1", "dep-uid"))
        r.observe_replicaset("ADDED", _replicaset("impostor-abc", "rs-2", "other-dep"))
        r.observe_pod("ADDED", _pod("smollm2-abc-1", "rs-1"))
        r.observe_pod("ADDED", _pod("copycat", None))
        r.observe_pod("ADDED", _pod("impostor-abc-1", "rs-2"))
        assert set(r.owned_pods(("models", "smollm2"))) == {"smollm2-abc-1"}
        r.observe_replicaset("DELETED", _replicaset("smollm2-abc", "rs-1", "dep-uid"))
        assert r.owned_pods(("models", "smollm2")) == {}
        await r.close()

    asyncio.run(run())
