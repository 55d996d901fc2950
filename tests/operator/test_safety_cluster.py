"""Safe by default on the dev cluster: a model never takes over an object it does not own
(Failed with a reason naming it, left alone on deletion, recovered once it is gone), and a
hostpath:// model outside the operator's allowed folders goes Failed. No runtime pod runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kubeinfer.devcluster.testing import DevClusterHandle, wait_for
from tests.operator.test_operator_cluster import GROUP, PLURAL, VERSION, Cluster, operator_namespace

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(
    dev_cluster: DevClusterHandle, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    with operator_namespace(dev_cluster, "safe", tmp_path_factory.mktemp("safety")) as c:
        yield c


def model_body(name: str, uri: str = "pvc://weights") -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceModel",
        "metadata": {"name": name},
        "spec": {"model": {"uri": uri}, "replicas": 0},
    }


def their_service(cluster: Cluster, name: str) -> None:
    cluster.dev.core.create_namespaced_service(
        cluster.ns,
        {
            "metadata": {"name": name, "labels": {"team": "theirs"}},
            "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]},
        },
    )


def ready_condition(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def test_a_service_of_the_models_name_is_not_taken_over(cluster: Cluster) -> None:
    their_service(cluster, "taken")
    cluster.custom.create_namespaced_custom_object(
        GROUP, VERSION, cluster.ns, PLURAL, model_body("taken")
    )
    status = cluster.wait_phase("taken", "Failed", 30)
    ready = ready_condition(status)
    assert ready["reason"] == "NotOwned" and f"Service {cluster.ns}/taken" in ready["message"]
    # the model's own new Deployment may exist (its urgent write comes before the Service's
    # read); it is the model's, and goes with it
    dep = cluster.get("Deployment", "taken")
    assert dep is None or dep["metadata"]["ownerReferences"][0]["kind"] == "InferenceModel"
    svc = cluster.get("Service", "taken")
    assert svc is not None and not svc["metadata"].get("ownerReferences")
    assert svc["spec"]["selector"] == {"app": "theirs"}
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "taken")

    def model_gone() -> bool:
        try:
            cluster.model("taken")
        except ApiException as exc:
            return exc.status == 404
        return False

    wait_for(model_gone, timeout_s=30, what="the model to go")
    assert cluster.get("Service", "taken") is not None  # deletion never removes it


def test_the_model_recovers_once_the_foreign_object_is_gone(cluster: Cluster) -> None:
    their_service(cluster, "blocked")
    cluster.custom.create_namespaced_custom_object(
        GROUP, VERSION, cluster.ns, PLURAL, model_body("blocked")
    )
    cluster.wait_phase("blocked", "Failed", 30)
    cluster.dev.core.delete_namespaced_service("blocked", cluster.ns)
    cluster.wait_phase("blocked", "Pending", 60)  # the handler's slow retry (30 s)
    svc = cluster.get("Service", "blocked")
    assert svc is not None and svc["metadata"]["ownerReferences"][0]["kind"] == "InferenceModel"


def test_hostpath_outside_the_allowed_folders_fails(cluster: Cluster) -> None:
    cluster.custom.create_namespaced_custom_object(
        GROUP, VERSION, cluster.ns, PLURAL, model_body("etc", "hostpath:///etc")
    )
    status = cluster.wait_phase("etc", "Failed", 30)
    assert "not under an allowed folder" in ready_condition(status)["message"]
    assert cluster.get("Deployment", "etc") is None
