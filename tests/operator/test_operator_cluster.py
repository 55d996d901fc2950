"""The operator on the dev cluster, end to end, with the real runtime serving SmolLM2.

One operator subprocess watches one fresh namespace. The tests run in order on one model
(`smollm2` from examples/smollm2.yaml): Ready and serving, printer columns, drift repair,
scale to 2 and back, a spec change that rolls, an operator crash and restart, and the
garbage collection of its children; beside it, models the runtime cannot load and one the
operator cannot serve. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kubeinfer.devcluster.testing import DevClusterHandle, wait_for
from kubeinfer.operator.testing import OperatorProcess
from kubeinfer.runtime.testing import write_random_checkpoint
from tests.operator.conftest import CRD_PATH, example_model

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

GROUP, VERSION, PLURAL = "kubeinfer.dev", "v1alpha1", "inferencemodels"
READY_TIMEOUT_S = 240  # SmolLM2 on a shared 2-core machine
REPAIR_TIMEOUT_S = 5  # the bound for drift repair


class Cluster:
    """The dev cluster, the test namespace and the operator, with small helpers."""

    def __init__(self, dev: DevClusterHandle, ns: str, log_dir: Path) -> None:
        self.dev, self.ns, self.log_dir = dev, ns, log_dir
        self.custom = client.CustomObjectsApi(dev.api_client)
        self.operator: OperatorProcess | None = None

    def start_operator(self) -> None:
        self.operator = OperatorProcess.start(
            self.dev.kubeconfig, [self.ns], self.log_dir / "operator.log"
        )

    def model(self, name: str = "smollm2") -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def patch_model(self, name: str, patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.ns, PLURAL, name, patch,
            _content_type="application/merge-patch+json",
        )  # fmt: skip

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        read = {
            "Deployment": self.dev.apps.read_namespaced_deployment,
            "Service": self.dev.core.read_namespaced_service,
            "PodDisruptionBudget": client.PolicyV1Api(
                self.dev.api_client
            ).read_namespaced_pod_disruption_budget,
        }[kind]
        try:
            return self.dev.api_client.sanitize_for_serialization(read(name, self.ns))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def pods(self, name: str) -> list[dict[str, Any]]:
        pods = self.dev.core.list_namespaced_pod(
            self.ns,  # the runtime's pods, not the router's
            label_selector=f"app.kubernetes.io/name=kubeinfer-runtime,app.kubernetes.io/instance={name}",
        )
        return [self.dev.api_client.sanitize_for_serialization(p) for p in pods.items]

    def wait_phase(self, name: str, phase: str, timeout_s: float, **fields: int) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            status = self.model(name).get("status") or {}
            ok = status.get("phase") == phase and all(status.get(k) == v for k, v in fields.items())
            return status if ok else None

        try:
            return wait_for(check, timeout_s=timeout_s, what=f"{name} phase {phase} {fields}")
        except AssertionError as exc:
            status = self.model(name).get("status") or {}
            raise AssertionError(
                f"{exc}\nstatus: {json.dumps(status)}\n{self.diagnostics()}"
            ) from None

    def diagnostics(self) -> str:
        op = self.operator.tail(3000) if self.operator else ""
        return f"--- operator log ---\n{op}"

    def apply_model(self, model: dict[str, Any]) -> None:
        """`kubectl apply` a model body (kept in the log folder)."""
        path = self.log_dir / f"{model['metadata']['name']}.json"
        path.write_text(json.dumps(model))
        self.dev.kubectl("apply", "-f", str(path))


@contextmanager
def operator_namespace(dev: DevClusterHandle, prefix: str, log_dir: Path) -> Iterator[Cluster]:
    """The CRD established, a fresh namespace and one operator watching it. On exit: the
    models deleted first, while the operator runs (an autoscaling model carries a finalizer),
    then the operator stopped and the namespace deleted."""
    dev.kubectl("apply", "-f", str(CRD_PATH))
    dev.kubectl(
        "wait", "--for=condition=established", "crd/inferencemodels.kubeinfer.dev", "--timeout=60s"
    )
    c = Cluster(dev, dev.namespace(prefix), log_dir)
    c.start_operator()
    try:
        yield c
    finally:
        dev.kubectl("delete", "inferencemodels", "--all", "-n", c.ns, "--wait=false", check=False)
        if c.operator is not None:
            c.operator.stop()
        dev.delete_namespace(c.ns)


@pytest.fixture(scope="module")
def cluster(
    dev_cluster: DevClusterHandle, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    with operator_namespace(dev_cluster, "op", tmp_path_factory.mktemp("operator")) as c:
        yield c


@pytest.fixture(scope="module")
def weights_dir() -> Iterator[Path]:
    """Test checkpoints live in kubeinfer's cache, never under /tmp (nor a checkout there): the
    dev node agent rewrites mount paths in a container's arguments one after the other, so with
    the runtime pod's /tmp emptyDir a hostPath under /tmp is rewritten twice."""
    cache = Path(os.environ.get("KUBEINFER_CACHE", Path.home() / ".cache" / "kubeinfer"))
    root = cache / "operator-tests" / f"w{time.time_ns()}"
    root.mkdir(parents=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def model_events(cluster: Cluster) -> set[str]:
    """Reasons of the events about InferenceModels in the test namespace."""
    events = cluster.dev.core.list_namespaced_event(cluster.ns).items
    return {e.reason for e in events if e.involved_object.kind == "InferenceModel"}


def _args(deployment: dict[str, Any]) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_example_becomes_a_ready_served_model(cluster: Cluster, smollm2_dir: Path) -> None:
    model_file = cluster.log_dir / "smollm2.yaml"
    model_file.write_text(json.dumps(example_model(smollm2_dir.resolve(), cluster.ns)))
    cluster.dev.kubectl("apply", "-f", str(model_file))
    uid = cluster.model()["metadata"]["uid"]

    dep = wait_for(lambda: cluster.get("Deployment", "smollm2"), timeout_s=30, what="Deployment")
    svc = wait_for(lambda: cluster.get("Service", "smollm2"), timeout_s=30, what="Service")
    for child in (dep, svc):
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "InferenceModel", "smollm2", uid, True,
        )  # fmt: skip
        assert any(f["manager"] == "kubeinfer" for f in child["metadata"]["managedFields"])
    args = _args(dep)
    assert args[args.index("--served-model-name") + 1] == "smollm2"
    assert args[args.index("--host") + 1] == "$(POD_IP)"
    assert dep["spec"]["replicas"] == 1
    assert svc["spec"]["ports"][0]["name"] == "http" and svc["spec"]["ports"][0]["port"] == 8000

    status = cluster.wait_phase("smollm2", "Ready", READY_TIMEOUT_S, readyReplicas=1)
    assert status["endpoint"] == f"http://smollm2.{cluster.ns}.svc:8000/v1"
    assert status["selector"].startswith("app.kubernetes.io/instance=smollm2")
    assert status["observedGeneration"] == cluster.model()["metadata"]["generation"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"

    (pod,) = [p for p in cluster.pods("smollm2") if p["status"].get("podIP")]
    ip = pod["status"]["podIP"]  # a 127.1.x.y loopback address: the pod IP, never the ClusterIP
    models = httpx.get(f"http://{ip}:8000/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["smollm2"]

    assert cluster.operator is not None
    metrics = httpx.get(cluster.operator.metrics_url, timeout=5).text
    assert 'kubeinfer_operator_reconciles_total{result="applied"}' in metrics
    wait_for(lambda: {"Applied", "Ready"} <= model_events(cluster), timeout_s=10,
             what="Applied and Ready events")  # fmt: skip


def test_kubectl_get_im_shows_the_printer_columns(cluster: Cluster) -> None:
    out = cluster.dev.kubectl("get", "im", "-n", cluster.ns)
    header, *rows = out.strip().splitlines()
    assert header.split() == ["NAME", "MODEL", "REPLICAS", "READY", "TOKENS/S", "PHASE",
                              "ENDPOINT", "AGE"]  # fmt: skip
    row = next(r.split() for r in rows if r.startswith("smollm2 "))
    assert row[1].startswith("hostpath:///") and row[2] == "1" and row[3] == "1"
    assert row[4] == "Ready"  # Tokens/s is empty until the autoscaler reports metrics
    assert row[5] == f"http://smollm2.{cluster.ns}.svc:8000/v1"


def test_deleted_or_edited_children_are_restored(cluster: Cluster) -> None:
    before = cluster.get("Deployment", "smollm2")
    assert before is not None
    cluster.dev.apps.delete_namespaced_deployment("smollm2", cluster.ns)
    start = time.monotonic()

    def recreated() -> dict[str, Any] | None:
        dep = cluster.get("Deployment", "smollm2")
        return dep if dep and dep["metadata"]["uid"] != before["metadata"]["uid"] else None

    dep = wait_for(recreated, timeout_s=REPAIR_TIMEOUT_S, what="the Deployment to be recreated")
    assert time.monotonic() - start < REPAIR_TIMEOUT_S

    good_args = _args(dep)
    i = good_args.index("--max-num-seqs") + 1
    cluster.dev.apps.patch_namespaced_deployment(
        "smollm2", cluster.ns,
        [{"op": "replace", "path": f"/spec/template/spec/containers/0/args/{i}", "value": "1"}],
        _content_type="application/json-patch+json",
    )  # fmt: skip
    wait_for(
        lambda: _args(cluster.get("Deployment", "smollm2") or {}) == good_args,
        timeout_s=REPAIR_TIMEOUT_S,
        what="the edited args to be restored",
    )

    cluster.dev.core.delete_namespaced_service("smollm2", cluster.ns)
    wait_for(lambda: cluster.get("Service", "smollm2"), timeout_s=REPAIR_TIMEOUT_S,
             what="the Service to be recreated")  # fmt: skip
    wait_for(lambda: "DriftRepaired" in model_events(cluster), timeout_s=10,
             what="a DriftRepaired event")  # fmt: skip


def test_scale_to_two_then_back(cluster: Cluster) -> None:
    cluster.dev.kubectl("scale", "im", "smollm2", "-n", cluster.ns, "--replicas", "2")
    wait_for(lambda: cluster.get("PodDisruptionBudget", "smollm2"), timeout_s=10, what="PDB")
    cluster.wait_phase("smollm2", "Ready", READY_TIMEOUT_S, readyReplicas=2, replicas=2)
    # terminating pods are no capacity (a pod of the drift test's rollout may still be draining,
    # Ready through its shutdown delay)
    ready = [
        p for p in cluster.pods("smollm2")
        if not p["metadata"].get("deletionTimestamp")
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"]["conditions"])
    ]  # fmt: skip
    assert len(ready) == 2

    cluster.dev.kubectl("scale", "im", "smollm2", "-n", cluster.ns, "--replicas", "1")
    wait_for(lambda: cluster.get("PodDisruptionBudget", "smollm2") is None, timeout_s=10,
             what="the PDB to go with one replica")  # fmt: skip
    cluster.wait_phase("smollm2", "Ready", 60, readyReplicas=1, replicas=1)


def test_spec_change_rolls_out_new_pods(cluster: Cluster) -> None:
    old_pods = {p["metadata"]["name"] for p in cluster.pods("smollm2")}
    cluster.patch_model("smollm2", {"spec": {"runtime": {"maxNumSeqs": 8}}})
    generation = cluster.model()["metadata"]["generation"]

    def rolled() -> bool:
        pods = [p for p in cluster.pods("smollm2") if not p["metadata"].get("deletionTimestamp")]
        args = [p["spec"]["containers"][0]["args"] for p in pods]
        return bool(pods) and all(a[a.index("--max-num-seqs") + 1] == "8" for a in args)

    # zero downtime: the old pod stays until the new one has loaded and is Ready
    wait_for(rolled, timeout_s=READY_TIMEOUT_S, what="pods with --max-num-seqs 8")
    # the status of the generation before also reads Ready 1/1/1: until the operator's write
    # for this one lands (just after the rollout starts), only observedGeneration tells them
    # apart, so wait for it first (CI once read the old status here: 3 == 4)
    wait_for(
        lambda: (cluster.model().get("status") or {}).get("observedGeneration") == generation,
        timeout_s=10,
        what=f"status for generation {generation}",
    )
    status = cluster.wait_phase("smollm2", "Ready", READY_TIMEOUT_S, readyReplicas=1,
                                updatedReplicas=1, replicas=1,
                                observedGeneration=generation)  # fmt: skip
    assert status["observedGeneration"] == generation
    # the old pod may still be draining (SIGTERM, its grace period): wait until it is gone
    wait_for(
        lambda: not {p["metadata"]["name"] for p in cluster.pods("smollm2")} & old_pods,
        timeout_s=90,
        what="the old pods gone",
    )


def test_operator_restart_converges_without_duplicates(cluster: Cluster) -> None:
    assert cluster.operator is not None
    cluster.operator.kill()  # as a crash would
    # while it is down: a child goes away and the model changes
    cluster.dev.core.delete_namespaced_service("smollm2", cluster.ns)
    cluster.patch_model("smollm2", {"spec": {"replicas": 0}})
    cluster.start_operator()
    wait_for(lambda: cluster.get("Service", "smollm2"), timeout_s=30, what="Service restored")
    wait_for(
        lambda: (cluster.get("Deployment", "smollm2") or {}).get("spec", {}).get("replicas") == 0,
        timeout_s=30,
        what="the Deployment scaled to 0",
    )
    status = cluster.wait_phase("smollm2", "Pending", 60, replicas=0)
    assert status["observedGeneration"] == cluster.model()["metadata"]["generation"]
    deployments = cluster.dev.apps.list_namespaced_deployment(cluster.ns).items
    services = cluster.dev.core.list_namespaced_service(cluster.ns).items
    assert [d.metadata.name for d in deployments if d.metadata.name == "smollm2"] == ["smollm2"]
    assert [s.metadata.name for s in services if s.metadata.name == "smollm2"] == ["smollm2"]


def test_spec_the_operator_cannot_serve_fails_without_a_crash_loop(cluster: Cluster) -> None:
    # The CRD allows it; the Deployment's own validation does not (Exists takes no value).
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceModel",
        "metadata": {"name": "unservable"},
        "spec": {
            "model": {"uri": "pvc://weights"},
            "replicas": 0,
            "scheduling": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
        },
    }
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, body)
    status = cluster.wait_phase("unservable", "Failed", 30)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidSpec" and "tolerations" in ready["message"], ready
    assert cluster.operator is not None and cluster.operator.proc.poll() is None
    cluster.patch_model("unservable", {"spec": {"scheduling": {"tolerations": []}}})
    cluster.wait_phase("unservable", "Pending", 30)  # fixed: scaled to zero
    assert cluster.get("Deployment", "unservable") is not None


def test_unloadable_weights_report_the_runtime_load_error(
    cluster: Cluster, weights_dir: Path
) -> None:
    corrupt = weights_dir / "corrupt"
    write_random_checkpoint(corrupt)
    for f in corrupt.glob("*.safetensors"):
        f.write_bytes(b"\xff" * 64)  # a header length far past the end of the file
    empty = weights_dir / "empty"
    empty.mkdir()
    expected = {"corrupt": "safetensors", "empty": str(empty)}
    for name, folder in (("corrupt", corrupt), ("empty", empty)):
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceModel",
            "metadata": {"name": name},
            "spec": {
                "model": {"uri": f"hostpath://{folder}"},
                "runtime": {"extraArgs": ["--device", "cpu", "--num-kv-blocks", "16"]},
                "resources": {"gpus": 0, "cpu": "1", "memory": "1Gi"},
            },
        }
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, body)
    for name, text in expected.items():
        status = cluster.wait_phase(name, "Failed", READY_TIMEOUT_S)
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert "model failed to load" in ready["message"] and text in ready["message"], ready
        assert status["readyReplicas"] == 0
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True"
    for name in expected:
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, name)


def test_deleting_the_model_collects_its_children(cluster: Cluster) -> None:
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "smollm2")
    wait_for(
        lambda: (
            cluster.get("Deployment", "smollm2") is None
            and cluster.get("Service", "smollm2") is None
        ),
        timeout_s=60,
        what="the children to be garbage-collected",
    )


def test_autoscaling_model_gets_the_daemon_and_replicas_through_scale(cluster: Cluster) -> None:
    """With autoscaling on the applied Deployment carries no replicas; the operator sets them
    through the scale subresource under its own manager, and the autoscaler's daemon writes
    its conditions beside the operator's (each under its own field manager)."""
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceModel",
        "metadata": {"name": "scaled"},
        "spec": {
            "model": {"uri": "pvc://weights"},
            "replicas": 0,
            "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2},
        },
    }
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, body)

    def both_wrote() -> dict[str, Any] | None:
        status = cluster.model("scaled").get("status") or {}
        types = {c["type"] for c in status.get("conditions") or []}
        return status if {"Ready", "ScalingActive"} <= types else None

    wait_for(both_wrote, timeout_s=30, what="operator and autoscaler conditions")
    dep = cluster.get("Deployment", "scaled")
    assert dep is not None and dep["spec"]["replicas"] == 0
    owners = {f["manager"]: f for f in dep["metadata"]["managedFields"]}
    assert "f:replicas" not in json.dumps(owners["kubeinfer"]["fieldsV1"]["f:spec"])
    assert "kubeinfer.dev/operator" in cluster.model("scaled")["metadata"]["finalizers"]
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "scaled")
    wait_for(lambda: _is_gone(cluster, "scaled"), timeout_s=30, what="the finalizer released")


def _is_gone(cluster: Cluster, name: str) -> bool:
    try:
        cluster.model(name)
    except ApiException as exc:
        return exc.status == 404
    return False
