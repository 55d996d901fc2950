"""Routing mode inferencePool: render() and the reconciler, without a cluster (on the dev
cluster with the upstream CRD: tests/operator/test_inference_pool_cluster.py)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from kubeinfer.operator.kube import NotFoundError
from kubeinfer.operator.manifests import KIND, child_id, render
from kubeinfer.operator.settings import OperatorSettings
from tests.operator.conftest import make_model
from tests.operator.test_reconciler import KEY, converge, setup

CONFIG = OperatorSettings()
POOL_SPEC = {"model": {"uri": "pvc://w"}, "routing": {"mode": "inferencePool"}}


def children(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {child_id(m, model["metadata"]["name"]): m for m in render(model, CONFIG)}


def test_the_pool_selects_the_runtime_pods_on_their_api_port() -> None:
    out = children(make_model(POOL_SPEC))
    assert set(out) == {"Deployment", "Service", "InferencePool"}  # no router
    pool = out["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "smollm2"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "1234-abcd"
    runtime = out["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= runtime.items()
    assert (
        pool["spec"]["selector"]["matchLabels"]
        == out["Deployment"]["spec"]["selector"]["matchLabels"]
    )
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert "endpointPickerRef" not in pool["spec"]
    # the Service is the plain one: the runtime pods
    assert out["Service"]["spec"]["selector"] == pool["spec"]["selector"]["matchLabels"]


def test_an_endpoint_picker_becomes_the_pools_ref() -> None:
    spec = copy.deepcopy(POOL_SPEC)
    spec["routing"]["endpointPicker"] = {"name": "smollm2-epp"}
    pool = children(make_model(spec))["InferencePool"]
    assert pool["spec"]["endpointPickerRef"] == {"name": "smollm2-epp", "port": {"number": 9002}}


def test_leaving_mode_inference_pool_deletes_the_pool() -> None:
    r, api = setup(make_model(POOL_SPEC))
    converge(r)
    assert ("InferencePool", *KEY) in api.objects
    model = copy.deepcopy(api.objects[(KIND, *KEY)])
    model["spec"]["routing"] = {"mode": "service"}
    model["metadata"]["generation"] = 2
    api.objects[(KIND, *KEY)] = model
    r.observe(KIND, "MODIFIED", model)
    converge(r)
    assert "delete InferencePool" in api.calls
    assert ("InferencePool", *KEY) not in api.objects


def test_a_cluster_without_the_pool_api_fails_the_model_and_looks_again() -> None:
    r, api = setup(make_model(POOL_SPEC))
    apply = api.apply

    async def apply_without_pools(manifest: dict[str, Any], **kw: Any) -> dict[str, Any]:
        if manifest["kind"] == "InferencePool":
            raise NotFoundError(404, "HTTP 404: the server could not find the requested resource")
        return await apply(manifest, **kw)

    api.apply = apply_without_pools  # type: ignore[method-assign]
    requeues = converge(r)
    assert requeues[-1] == 30.0
    status = api.objects[(KIND, *KEY)]["status"]
    assert status["phase"] == "Failed"
    ready = status["conditions"][0]
    assert (
        ready["reason"] == "APINotInstalled"
        and "inference.networking.k8s.io/v1" in (ready["message"])
    )
    assert "event APINotInstalled" in api.calls
    assert asyncio.run(r.reconcile(KEY)) == 30.0  # still failing, no second event
    assert api.calls.count("event APINotInstalled") == 1
