"""Routing mode inferencePool on the dev cluster, with the upstream InferencePool CRD fetched
from its Go module (`devcluster/upstream.py`): the operator's pool is accepted under the
upstream schema (strict field validation), owned by the model, and selects exactly the model's
runtime pods, whose API port serves what the standard endpoint picker reads.

Every connection goes to a 127.x pod IP; every wait is bounded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client

from kubeinfer.devcluster.testing import DevClusterHandle, wait_for
from kubeinfer.devcluster.upstream import inference_pool_crd
from kubeinfer.operator.manifests import render
from kubeinfer.operator.settings import OperatorSettings
from tests.operator.conftest import example_model
from tests.operator.test_operator_cluster import READY_TIMEOUT_S, Cluster, operator_namespace

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

POOLS = ("inference.networking.k8s.io", "v1", "inferencepools")
POOLED, OTHER = "pooled", "other"


@pytest.fixture(scope="module")
def pooled(
    dev_cluster: DevClusterHandle, tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Iterator[Cluster]:
    pool_crd = "inferencepools.inference.networking.k8s.io"
    dev_cluster.kubectl("apply", "--server-side", "-f", str(inference_pool_crd()))
    dev_cluster.kubectl("wait", "--for=condition=established", f"crd/{pool_crd}", "--timeout=60s")
    with operator_namespace(dev_cluster, "pool", tmp_path_factory.mktemp("pool")) as c:
        for name, mode in ((POOLED, "inferencePool"), (OTHER, "service")):
            model = example_model(smollm2_dir.resolve(), c.ns)
            model["metadata"]["name"] = name
            model["spec"]["routing"] = {"mode": mode}
            c.apply_model(model)
        yield c


def pool(c: Cluster) -> dict[str, Any]:
    return c.custom.get_namespaced_custom_object(POOLS[0], POOLS[1], c.ns, POOLS[2], POOLED)


def test_the_pool_is_accepted_by_the_upstream_schema(pooled: Cluster) -> None:
    c = pooled
    got = wait_for(lambda: pool(c), timeout_s=30, what="the InferencePool")
    model = c.model(POOLED)
    (ref,) = got["metadata"]["ownerReferences"]
    uid = model["metadata"]["uid"]
    assert (ref["kind"], ref["name"], ref["uid"]) == ("InferenceModel", POOLED, uid)
    assert got["spec"]["targetPorts"] == [{"number": 8000}]
    # the rendered object as a new one, strictly validated (unknown fields refused), not kept
    settings = OperatorSettings(allow_hostpath=True, hostpath_prefixes=["/"])
    (manifest,) = [m for m in render(model, settings) if m["kind"] == "InferencePool"]
    manifest = {**manifest, "metadata": {**manifest["metadata"], "name": "dry-run"}}
    c.custom.create_namespaced_custom_object(
        *POOLS[:2], c.ns, POOLS[2], manifest, dry_run="All", field_validation="Strict"
    )
    out = c.dev.kubectl("get", "inferencepools", "-n", c.ns)
    assert POOLED in out


def test_the_pool_selects_exactly_the_models_runtime_pods(pooled: Cluster) -> None:
    c = pooled
    c.wait_phase(POOLED, "Ready", READY_TIMEOUT_S, readyReplicas=1)
    c.wait_phase(OTHER, "Ready", READY_TIMEOUT_S, readyReplicas=1)
    labels = pool(c)["spec"]["selector"]["matchLabels"]
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    selected = c.dev.core.list_namespaced_pod(c.ns, label_selector=selector).items
    live = [p for p in selected if p.metadata.deletion_timestamp is None]
    assert {p.metadata.name for p in live} == {p["metadata"]["name"] for p in c.pods(POOLED)}
    assert not {p.metadata.name for p in live} & {p["metadata"]["name"] for p in c.pods(OTHER)}
    assert not any(p.metadata.labels.get("app.kubernetes.io/name") == "kubeinfer-router"
                   for p in live)  # fmt: skip
    # what an endpoint picker reads, on the pool's target port of the selected pod
    (pod,) = live
    assert pod.status.pod_ip.startswith("127.")
    text = httpx.get(f"http://{pod.status.pod_ip}:8000/metrics", timeout=10).text
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:cache_config_info"):
        assert name in text, name


def test_no_router_runs_for_either_model(pooled: Cluster) -> None:
    c = pooled
    pods = (
        client.CoreV1Api(c.dev.api_client)
        .list_namespaced_pod(c.ns, label_selector="app.kubernetes.io/name=kubeinfer-router")
        .items
    )
    assert pods == []
    assert c.get("Service", POOLED) is not None
