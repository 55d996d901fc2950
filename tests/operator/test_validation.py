"""The API server rejects invalid InferenceModels (the CRD's schema and CEL rules), each with a
message that names the field. Server-side dry runs: nothing is stored, no operator needed."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kubeinfer.devcluster.testing import DevClusterHandle, wait_for
from kubeinfer.operator.manifests import MANAGED_ENV, MANAGED_FLAGS
from tests.operator.conftest import CRD_PATH, REPO

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

VALID: dict[str, Any] = {
    "apiVersion": "kubeinfer.dev/v1alpha1",
    "kind": "InferenceModel",
    "metadata": {"name": "valid"},
    "spec": {"model": {"uri": "pvc://models/smollm2-135m"}},
}


def with_spec(path: str, value: Any) -> dict[str, Any]:
    """VALID with spec.PATH (dotted; `-` deletes) set to value."""
    body = copy.deepcopy(VALID)
    *parents, leaf = path.split(".")
    node = body
    for part in parents:
        node = node.setdefault(part, {})
    if value == "-":
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return body


# (case, body, text the message must contain)
INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("replicas as a string", with_spec("spec.replicas", "two"), "spec.replicas"),
    ("negative replicas", with_spec("spec.replicas", -1), "spec.replicas"),
    ("too many replicas", with_spec("spec.replicas", 1001), "spec.replicas"),
    ("no model", with_spec("spec.model", "-"), "spec.model"),
    ("no model uri", with_spec("spec.model", {"servedName": "x"}), "spec.model.uri"),
    ("s3 scheme", with_spec("spec.model.uri", "s3://bucket/m"), "spec.model.uri"),
    ("relative hostpath", with_spec("spec.model.uri", "hostpath://data/m"), "spec.model.uri"),
    ("bad claim name", with_spec("spec.model.uri", "pvc://Bad_Claim/x"), "spec.model.uri"),
    ("hf without org", with_spec("spec.model.uri", "hf://smollm2"), "spec.model.uri"),
    ("dot-dot path", with_spec("spec.model.uri", "pvc://c/../etc"), "spec.model.uri"),
    ("bad served name", with_spec("spec.model.servedName", "has space"), "spec.model.servedName"),
    ("bad dtype", with_spec("spec.runtime", {"dtype": "int4"}), "spec.runtime.dtype"),
    ("zero max len", with_spec("spec.runtime", {"maxModelLen": 0}), "spec.runtime.maxModelLen"),
    ("seqs as text", with_spec("spec.runtime", {"maxNumSeqs": "many"}), "spec.runtime.maxNumSeqs"),
    (
        "kv fraction over 1",
        with_spec("spec.runtime", {"kvCacheMemoryFraction": 1.5}),
        "spec.runtime.kvCacheMemoryFraction",
    ),
    (
        "kv fraction zero",
        with_spec("spec.runtime", {"kvCacheMemoryFraction": 0}),
        "spec.runtime.kvCacheMemoryFraction",
    ),
    (
        "token budget below seqs",
        with_spec("spec.runtime", {"maxNumBatchedTokens": 64, "maxNumSeqs": 256}),
        "spec.runtime.maxNumBatchedTokens",
    ),
    (
        "extraArgs not a list",
        with_spec("spec.runtime", {"extraArgs": "--x"}),
        "spec.runtime.extraArgs",
    ),
    (
        "prefix caching as text",
        with_spec("spec.runtime", {"enablePrefixCaching": "yes"}),
        "spec.runtime.enablePrefixCaching",
    ),
    (
        "env without name",
        with_spec("spec.runtime", {"env": [{"value": "1"}]}),
        "spec.runtime.env[0].name",
    ),
    (
        "env value and valueFrom",
        with_spec("spec.runtime", {"env": [{"name": "A", "value": "1", "valueFrom": {}}]}),
        "spec.runtime.env[0]",
    ),
    ("17 gpus", with_spec("spec.resources", {"gpus": 17}), "spec.resources.gpus"),
    *(
        (
            f"tensor parallel {tp} on {gpus} gpus",
            {**VALID, "spec": {**VALID["spec"], "runtime": {"tensorParallelSize": tp},
                               "resources": {"gpus": gpus}}},
            "spec.runtime.tensorParallelSize",
        )
        for gpus, tp in ((4, 3), (2, 4), (6, 4), (1, 2), (16, 32))
    ),  # fmt: skip
    (
        "tensor parallel beside the default gpus",
        with_spec("spec.runtime", {"tensorParallelSize": 2}),
        "spec.runtime.tensorParallelSize",
    ),
    ("tensor parallel 0", with_spec("spec.runtime", {"tensorParallelSize": 0}),
     "spec.runtime.tensorParallelSize"),  # fmt: skip
    ("tensor parallel 65", with_spec("spec.runtime", {"tensorParallelSize": 65}),
     "spec.runtime.tensorParallelSize"),  # fmt: skip
    (
        "memory not a quantity",
        with_spec("spec.resources", {"memory": "lots"}),
        "spec.resources.memory",
    ),
    ("cpu not a quantity", with_spec("spec.resources", {"cpu": "4 cores"}), "spec.resources.cpu"),
    ("bad metric", with_spec("spec.autoscaling", {"metric": "qps"}), "spec.autoscaling.metric"),
    (
        "min over max",
        with_spec("spec.autoscaling", {"minReplicas": 5, "maxReplicas": 2}),
        "spec.autoscaling.minReplicas",
    ),
    (
        "zero target",
        with_spec("spec.autoscaling", {"targetPerReplica": 0}),
        "spec.autoscaling.targetPerReplica",
    ),
    (
        "additional metric repeats the metric",
        with_spec(
            "spec.autoscaling",
            {"additionalMetrics": [{"metric": "generationTokensPerSecond", "targetPerReplica": 5}]},
        ),
        "spec.autoscaling.additionalMetrics",
    ),
    (
        "additional metric twice",
        with_spec(
            "spec.autoscaling",
            {"additionalMetrics": [{"metric": "requestsWaiting", "targetPerReplica": 5}] * 2},
        ),
        "spec.autoscaling.additionalMetrics[1]",
    ),
    (
        "additional metric without a target",
        with_spec("spec.autoscaling", {"additionalMetrics": [{"metric": "requestsWaiting"}]}),
        "spec.autoscaling.additionalMetrics[0].targetPerReplica",
    ),
    (
        "additional metric unknown",
        with_spec(
            "spec.autoscaling", {"additionalMetrics": [{"metric": "qps", "targetPerReplica": 5}]}
        ),
        "spec.autoscaling.additionalMetrics[0].metric",
    ),
    (
        "panic window over stable",
        with_spec("spec.autoscaling", {"panicWindowSeconds": 120}),
        "spec.autoscaling.panicWindowSeconds",
    ),
    (
        "bad toleration operator",
        with_spec("spec.scheduling", {"tolerations": [{"key": "k", "operator": "Maybe"}]}),
        "spec.scheduling.tolerations[0].operator",
    ),
    (
        "api key name without key",
        with_spec("spec.apiKeySecretRef", {"name": "keys"}),
        "spec.apiKeySecretRef.key",
    ),
    ("hostpath root dot", with_spec("spec.model.uri", "hostpath:///."), "spec.model.uri"),
    ("hostpath dot segment", with_spec("spec.model.uri", "hostpath:///a/./b"), "spec.model.uri"),
    ("hostpath dot-dot end", with_spec("spec.model.uri", "hostpath:///a/.."), "spec.model.uri"),
    ("hostpath empty segment", with_spec("spec.model.uri", "hostpath:///a//b"), "spec.model.uri"),
    ("uri expansion", with_spec("spec.model.uri", "pvc://c/$(HOME)"), "spec.model.uri"),
    *(
        (
            f"extraArgs {flag}",
            with_spec("spec.runtime", {"extraArgs": ["--device", "cpu", flag, "x"]}),
            "spec.runtime.extraArgs",
        )
        for flag in MANAGED_FLAGS
    ),
    (
        "extraArgs --host=",
        with_spec("spec.runtime", {"extraArgs": ["--host=0.0.0.0"]}),
        "spec.runtime.extraArgs",
    ),
    *(
        (
            f"env {name}",
            with_spec("spec.runtime", {"env": [{"name": name, "value": "0.0.0.0"}]}),
            "spec.runtime.env",
        )
        for name in MANAGED_ENV
    ),
    ("rollout never progresses", with_spec("spec.rollout", {"maxSurge": 0}), "spec.rollout"),
    (
        "rollout both zero percent",
        with_spec("spec.rollout", {"maxSurge": "0%", "maxUnavailable": 0}),
        "spec.rollout",
    ),
    (
        "rollout surge text",
        with_spec("spec.rollout", {"maxSurge": "lots"}),
        "spec.rollout.maxSurge",
    ),
    (
        "rollout negative",
        with_spec("spec.rollout", {"maxUnavailable": -1}),
        "spec.rollout.maxUnavailable",
    ),
    ("unknown routing mode", with_spec("spec.routing", {"mode": "gateway"}), "spec.routing.mode"),
    ("zero routers", with_spec("spec.routing", {"replicas": 0}), "spec.routing.replicas"),
    (
        "negative held requests",
        with_spec("spec.routing", {"maxHeldRequests": -1}),
        "spec.routing.maxHeldRequests",
    ),
    (
        "scale to zero without minReplicas 0",
        with_spec("spec.autoscaling", {"enabled": True, "scaleToZeroAfterSeconds": 60}),
        "spec.autoscaling.scaleToZeroAfterSeconds",
    ),
    (
        "negative scale to zero",
        with_spec("spec.autoscaling", {"minReplicas": 0, "scaleToZeroAfterSeconds": -1}),
        "spec.autoscaling.scaleToZeroAfterSeconds",
    ),
    (
        "min zero without the router",
        {
            **with_spec("spec.autoscaling", {"enabled": True, "minReplicas": 0}),
            "spec": {
                "model": {"uri": "pvc://m"},
                "routing": {"mode": "service"},
                "autoscaling": {"enabled": True, "minReplicas": 0},
            },
        },
        "spec.autoscaling.minReplicas",
    ),  # fmt: skip
    ("unknown spec field", with_spec("spec.gpuCount", 2), "spec.gpuCount"),
    ("unknown nested field", with_spec("spec.runtime", {"maxSeqs": 8}), "spec.runtime.maxSeqs"),
    ("name not DNS-1035", with_spec("metadata.name", "1model"), "metadata.name"),
    ("name with capitals", with_spec("metadata.name", "SmolLM2"), "metadata.name"),
]


@pytest.fixture(scope="module")
def crd_ns(dev_cluster: DevClusterHandle) -> Iterator[str]:
    dev_cluster.kubectl("apply", "-f", str(CRD_PATH))
    dev_cluster.kubectl(
        "wait", "--for=condition=established", "crd/inferencemodels.kubeinfer.dev", "--timeout=60s"
    )
    ns = dev_cluster.namespace("imval")
    yield ns
    dev_cluster.delete_namespace(ns)


def _create(dev: DevClusterHandle, ns: str, body: dict[str, Any]) -> None:
    client.CustomObjectsApi(dev.api_client).create_namespaced_custom_object(
        "kubeinfer.dev", "v1alpha1", ns, "inferencemodels", body,
        dry_run="All", field_validation="Strict",
    )  # fmt: skip


def test_the_table_is_large_enough() -> None:
    assert len(INVALID) >= 20


def test_valid_model_is_accepted(dev_cluster: DevClusterHandle, crd_ns: str) -> None:
    # the CRD may take a moment to be served after it is established
    wait_for(lambda: _create(dev_cluster, crd_ns, VALID) or True, timeout_s=30, what="dry run")


@pytest.mark.parametrize(("case", "body", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_model_is_rejected(
    dev_cluster: DevClusterHandle, crd_ns: str, case: str, body: dict[str, Any], field: str
) -> None:
    with pytest.raises(ApiException) as info:
        _create(dev_cluster, crd_ns, body)
    assert info.value.status in (400, 422), info.value.body
    assert field in str(info.value.body), f"{case}: {info.value.body}"


@pytest.mark.parametrize(
    "spec_runtime",
    [
        {"extraArgs": ["--hostname", "x", "--model-cache", "y", "--device", "cpu"]},
        {"extraArgs": ["--num-kv-blocks", "256", "--kernels=torch"]},
        {"env": [{"name": "KUBEINFER_METRICS_FAULT_FILE", "value": "/tmp/f/$(POD_NAME)"}]},
    ],
)
def test_unmanaged_args_and_env_are_accepted(
    dev_cluster: DevClusterHandle, crd_ns: str, spec_runtime: dict[str, Any]
) -> None:
    body = with_spec("spec.runtime", spec_runtime)
    wait_for(lambda: _create(dev_cluster, crd_ns, body) or True, timeout_s=30, what="dry run")


@pytest.mark.parametrize(
    "spec",
    [
        {"routing": {"mode": "service"}},
        {"routing": {"mode": "inferencePool"}},
        {"routing": {"replicas": 2, "maxHeldRequests": 0, "maxHoldSeconds": 5}},
        {"autoscaling": {"enabled": True, "minReplicas": 0, "scaleToZeroAfterSeconds": 0}},
        {"autoscaling": {"enabled": False, "minReplicas": 0}, "routing": {"mode": "service"}},
    ],
)
def test_routing_and_scale_to_zero_are_accepted(
    dev_cluster: DevClusterHandle, crd_ns: str, spec: dict[str, Any]
) -> None:
    body = copy.deepcopy(VALID)
    body["spec"].update(spec)
    wait_for(lambda: _create(dev_cluster, crd_ns, body) or True, timeout_s=30, what="dry run")


@pytest.mark.parametrize(
    ("gpus", "tp"),
    [(4, None), (4, 4), (4, 2), (4, 1), (16, 8), (1, 1), (0, 1), (0, 4), (0, 64)],
)
def test_tensor_parallel_sizes_that_fit_the_gpus_are_accepted(
    dev_cluster: DevClusterHandle, crd_ns: str, gpus: int, tp: int | None
) -> None:
    runtime = {} if tp is None else {"tensorParallelSize": tp}
    body = copy.deepcopy(VALID)
    body["spec"].update({"runtime": runtime, "resources": {"gpus": gpus}})
    wait_for(lambda: _create(dev_cluster, crd_ns, body) or True, timeout_s=30, what="dry run")


@pytest.mark.parametrize(
    "rollout",
    [{}, {"maxSurge": 0, "maxUnavailable": 1}, {"maxSurge": "25%"}, {"maxUnavailable": "50%"}],
)
def test_rollout_bounds_are_accepted(
    dev_cluster: DevClusterHandle, crd_ns: str, rollout: dict[str, Any]
) -> None:
    body = with_spec("spec.rollout", rollout)
    wait_for(lambda: _create(dev_cluster, crd_ns, body) or True, timeout_s=30, what="dry run")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted(dev_cluster: DevClusterHandle, crd_ns: str, path: Path) -> None:
    body = yaml.safe_load(path.read_text().replace("MODEL_DIR", "/models/smollm2-135m"))
    wait_for(lambda: _create(dev_cluster, crd_ns, body) or True, timeout_s=30, what=path.name)
