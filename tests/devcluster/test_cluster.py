"""The dev cluster end to end: a real API server, controllers, scheduler, and pods run by the
node agent as local processes on 127.1.x.y. Each test works in a namespace of its own."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from kubeinfer.devcluster.config import REPO_ROOT as REPO
from kubeinfer.devcluster.config import pinned_kubernetes_version
from kubeinfer.devcluster.testing import DevClusterHandle, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

HTTP_CONTAINER = {
    "name": "http",
    "image": "python:3.11-slim",
    "command": ["python3", "-m", "http.server", "8080", "--bind", "$(POD_IP)"],
    "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
    "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1},
}


@pytest.fixture
def ns(dev_cluster: DevClusterHandle) -> Iterator[str]:
    name = dev_cluster.namespace()
    yield name
    dev_cluster.delete_namespace(name)


def _pods(dev: DevClusterHandle, namespace: str, selector: str = "") -> list[Any]:
    return list(dev.core.list_namespaced_pod(namespace, label_selector=selector).items)


def _is_ready(pod: Any) -> bool:
    return pod.status.phase == "Running" and any(
        c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []
    )


def _pid(pod: Any) -> int:
    return int(pod.status.container_statuses[0].container_id.removeprefix("dev://"))


def _deployment(name: str, replicas: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"terminationGracePeriodSeconds": 5, "containers": [HTTP_CONTAINER]},
            },
        },
    }


def _ready_pods(dev: DevClusterHandle, namespace: str, selector: str, count: int) -> list[Any]:
    def check() -> list[Any] | None:
        pods = [p for p in _pods(dev, namespace, selector) if not p.metadata.deletion_timestamp]
        return pods if len(pods) == count and all(_is_ready(p) for p in pods) else None

    return wait_for(check, timeout_s=60, what=f"{count} ready pods ({selector})")


def test_readyz_version_and_nodes(dev_cluster: DevClusterHandle) -> None:
    assert dev_cluster.kubectl("get", "--raw", "/readyz").strip() == "ok"
    version = json.loads(dev_cluster.kubectl("version", "-o", "json"))
    assert version["serverVersion"]["gitVersion"] == pinned_kubernetes_version()
    assert version["clientVersion"]["gitVersion"] == pinned_kubernetes_version()
    nodes = {n.metadata.name: n for n in dev_cluster.core.list_node().items}
    assert {"dev-gpu-0", "dev-gpu-1"} <= set(nodes)
    assert nodes["dev-gpu-0"].status.allocatable["nvidia.com/gpu"] == "8"


def test_helm_is_pinned_and_reaches_the_cluster(dev_cluster: DevClusterHandle) -> None:
    helm = dev_cluster.cluster.bin_dir / "helm"
    go_mod = REPO / "hack" / "controlplane" / "helm" / "go.mod"
    pinned = re.search(r"^require helm.sh/helm/v3 (v\S+)", go_mod.read_text(), re.MULTILINE)
    assert pinned
    done = subprocess.run(
        [str(helm), "version", "--template", "{{.Version}}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.strip() == pinned.group(1)
    done = subprocess.run(
        [str(helm), "list", "-A", "--kubeconfig", str(dev_cluster.kubeconfig)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_crd_can_be_created_and_used(dev_cluster: DevClusterHandle, ns: str) -> None:
    from kubernetes import client

    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.test.kubeinfer.dev"},
        "spec": {
            "group": "test.kubeinfer.dev",
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {"size": {"type": "integer"}},
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    ext = client.ApiextensionsV1Api(dev_cluster.api_client)
    try:
        ext.create_custom_resource_definition(crd)
    except client.exceptions.ApiException as exc:
        assert exc.status == 409  # left by an earlier session of a reused cluster

    def established() -> bool:
        got = ext.read_custom_resource_definition("widgets.test.kubeinfer.dev")
        return any(c.type == "Established" and c.status == "True" for c in got.status.conditions)

    wait_for(established, timeout_s=30, what="CRD established")
    objects = client.CustomObjectsApi(dev_cluster.api_client)
    body = {
        "apiVersion": "test.kubeinfer.dev/v1",
        "kind": "Widget",
        "metadata": {"name": "w1"},
        "spec": {"size": 3},
    }
    wait_for(
        lambda: objects.create_namespaced_custom_object(
            "test.kubeinfer.dev", "v1", ns, "widgets", body
        ),
        timeout_s=30,
        what="widget created",
    )
    got = objects.get_namespaced_custom_object("test.kubeinfer.dev", "v1", ns, "widgets", "w1")
    assert got["spec"] == {"size": 3}
    assert "w1" in dev_cluster.kubectl("get", "widgets", "-n", ns)


def test_deployment_serves_scales_and_replaces_pods(dev_cluster: DevClusterHandle, ns: str) -> None:
    dev = dev_cluster
    dev.apps.create_namespaced_deployment(ns, _deployment("web", 2))
    pods = _ready_pods(dev, ns, "app=web", 2)
    for pod in pods:
        assert pod.status.pod_ip.startswith("127.1.")
        assert httpx.get(f"http://{pod.status.pod_ip}:8080/", timeout=5).status_code == 200
        assert psutil.Process(_pid(pod)).is_running()
    assert len({p.status.pod_ip for p in pods}) == 2

    dev.apps.patch_namespaced_deployment_scale("web", ns, {"spec": {"replicas": 3}})
    pods = _ready_pods(dev, ns, "app=web", 3)
    pids = {p.metadata.name: _pid(p) for p in pods}
    assert all(psutil.pid_exists(pid) for pid in pids.values())

    dev.apps.patch_namespaced_deployment_scale("web", ns, {"spec": {"replicas": 1}})
    (kept,) = _ready_pods(dev, ns, "app=web", 1)
    gone = [pid for name, pid in pids.items() if name != kept.metadata.name]
    wait_for(
        lambda: not any(_alive(pid) for pid in gone),
        timeout_s=30,
        what="scaled-down pods' processes to exit",
    )

    dev.core.delete_namespaced_pod(kept.metadata.name, ns)
    (replacement,) = wait_for(
        lambda: [
            p for p in _ready_pods(dev, ns, "app=web", 1) if p.metadata.name != kept.metadata.name
        ],
        timeout_s=60,
        what="the ReplicaSet to replace a deleted pod",
    )
    assert httpx.get(f"http://{replacement.status.pod_ip}:8080/", timeout=5).status_code == 200
    wait_for(
        lambda: not _alive(pids[kept.metadata.name]),
        timeout_s=30,
        what="the deleted pod's process to exit",
    )


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _run_pod(
    dev: DevClusterHandle, ns: str, name: str, container: dict[str, Any], **spec: Any
) -> None:
    dev.core.create_namespaced_pod(
        ns,
        {
            "metadata": {"name": name},
            "spec": {"terminationGracePeriodSeconds": 2, "containers": [container], **spec},
        },
    )


def test_exiting_container_is_restarted(dev_cluster: DevClusterHandle, ns: str) -> None:
    _run_pod(
        dev_cluster,
        ns,
        "crash",
        {
            "name": "main",
            "image": "python:3.11-slim",
            "command": ["python3", "-c", "print('bye'); raise SystemExit(3)"],
        },
    )

    seen: list[Any] = [None]

    def restarted() -> Any:
        pod = dev_cluster.core.read_namespaced_pod("crash", ns)
        statuses = pod.status.container_statuses or []
        seen[0] = statuses[0] if statuses else pod.status
        return statuses and statuses[0].restart_count >= 2 and statuses[0]

    # Two crashes with the 1 s and 2 s back-offs take seconds on a quiet machine; the bound is
    # generous because CI once saw 60 s pass under load, and a timeout says what it last saw.
    try:
        status = wait_for(restarted, timeout_s=150, what="restartCount >= 2")
    except AssertionError as exc:
        events = dev_cluster.kubectl("get", "events", "-n", ns, "-o", "wide", check=False)
        raise AssertionError(
            f"{exc}\nlast container status: {seen[0]}\nevents:\n{events}\n"
            f"log:\n{dev_cluster.pod_log(ns, 'crash', 'main')[-2000:]}"
        ) from exc
    assert status.last_state.terminated.exit_code == 3
    assert dev_cluster.pod_log(ns, "crash", "main").count("bye") >= 2


def test_failing_liveness_probe_restarts_the_container(
    dev_cluster: DevClusterHandle, ns: str
) -> None:
    _run_pod(
        dev_cluster,
        ns,
        "unlive",
        {
            **HTTP_CONTAINER,
            "readinessProbe": None,
            "livenessProbe": {
                "exec": {"command": ["false"]},
                "periodSeconds": 1,
                "failureThreshold": 2,
            },
        },
    )
    wait_for(
        lambda: (
            dev_cluster.core.read_namespaced_pod("unlive", ns)
            .status.container_statuses[0]
            .restart_count
            >= 1
        ),
        timeout_s=60,
        what="a liveness restart",
    )


def test_failing_readiness_probe_keeps_pod_not_ready(
    dev_cluster: DevClusterHandle, ns: str
) -> None:
    container = {
        **HTTP_CONTAINER,
        "readinessProbe": {"httpGet": {"path": "/", "port": 9}, "periodSeconds": 1},
    }
    _run_pod(dev_cluster, ns, "unready", container)

    def running() -> Any:
        pod = dev_cluster.core.read_namespaced_pod("unready", ns)
        return pod.status.phase == "Running" and pod

    wait_for(running, timeout_s=60, what="pod Running")
    time.sleep(4)  # several probe periods
    pod = dev_cluster.core.read_namespaced_pod("unready", ns)
    assert not _is_ready(pod)
    assert pod.status.container_statuses[0].ready is False
    assert httpx.get(f"http://{pod.status.pod_ip}:8080/", timeout=5).status_code == 200


def test_unmapped_image_is_refused_with_reason_and_event(
    dev_cluster: DevClusterHandle, ns: str
) -> None:
    _run_pod(dev_cluster, ns, "nginx", {"name": "main", "image": "nginx:1.27"})

    def waiting_reason() -> str | None:
        statuses = dev_cluster.core.read_namespaced_pod("nginx", ns).status.container_statuses
        return statuses and statuses[0].state.waiting and statuses[0].state.waiting.reason

    assert wait_for(waiting_reason, timeout_s=30, what="a waiting reason") == "ImageNotMapped"
    events = wait_for(
        lambda: [
            e
            for e in dev_cluster.core.list_namespaced_event(ns).items
            if e.involved_object.name == "nginx" and e.reason == "Failed"
        ],
        timeout_s=30,
        what="a Failed event",
    )
    assert "nginx:1.27" in events[0].message


def test_pod_kubeconfig_carries_its_service_account_rbac(
    dev_cluster: DevClusterHandle, ns: str
) -> None:
    from kubernetes import client

    dev = dev_cluster
    dev.core.create_namespaced_service_account(ns, {"metadata": {"name": "reader"}})
    dev.core.create_namespaced_config_map(ns, {"metadata": {"name": "cfg"}, "data": {"a": "1"}})
    rbac = client.RbacAuthorizationV1Api(dev.api_client)
    rbac.create_namespaced_role(
        ns,
        {
            "metadata": {"name": "read-configmaps"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        ns,
        {
            "metadata": {"name": "reader"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "read-configmaps",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}],
        },
    )
    script = (
        "import os\n"
        "from kubernetes import client, config\n"
        "from kubernetes.client.exceptions import ApiException\n"
        "config.load_kube_config()\n"
        "api = client.CoreV1Api()\n"
        "ns = os.environ['NS']\n"
        "print('configmap', api.read_namespaced_config_map('cfg', ns).data['a'])\n"
        "try:\n"
        "    api.list_namespaced_pod(ns)\n"
        "    print('pods listed')\n"
        "except ApiException as exc:\n"
        "    print('pods status', exc.status)\n"
    )
    _run_pod(
        dev,
        ns,
        "rbac",
        {
            "name": "main",
            "image": "kubeinfer/operator:dev",
            "command": ["python", "-c", script],
            "env": [{"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        },
        serviceAccountName="reader",
        restartPolicy="Never",
    )
    wait_for(
        lambda: dev.core.read_namespaced_pod("rbac", ns).status.phase == "Succeeded",
        timeout_s=60,
        what="the RBAC pod to finish",
    )
    log = dev.pod_log(ns, "rbac", "main")
    assert "configmap 1" in log and "pods status 403" in log, log


def test_env_expansion_and_host_path_volume(
    dev_cluster: DevClusterHandle, ns: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    _run_pod(
        dev_cluster,
        ns,
        "writer",
        {
            "name": "main",
            "image": "python:3.11-slim",
            "command": [
                "python3",
                "-c",
                "import sys; open(sys.argv[1], 'w').write(sys.argv[2])",
                "/work/result.txt",
                "$(POD_NAME)@$(NODE)=$$(KEPT)",
            ],
            "env": [
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            ],
            "volumeMounts": [{"name": "work", "mountPath": "/work"}],
        },
        restartPolicy="Never",
        volumes=[{"name": "work", "hostPath": {"path": str(out), "type": "DirectoryOrCreate"}}],
    )
    wait_for(
        lambda: dev_cluster.core.read_namespaced_pod("writer", ns).status.phase == "Succeeded",
        timeout_s=60,
        what="the writer pod to finish",
    )
    name, _, rest = (out / "result.txt").read_text().partition("@")
    assert name == "writer" and rest.startswith("dev-gpu-") and rest.endswith("=$(KEPT)")


def test_deletion_sends_sigterm_then_sigkill_after_grace(
    dev_cluster: DevClusterHandle, ns: str
) -> None:
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('SIGTERM', 'ignored', flush=True); time.sleep(600)"
    )
    _run_pod(
        dev_cluster,
        ns,
        "stubborn",
        {
            "name": "main",
            "image": "python:3.11-slim",
            "command": ["python3", "-c", stubborn],
        },
    )
    pod = wait_for(
        lambda: (
            (p := dev_cluster.core.read_namespaced_pod("stubborn", ns)).status.phase == "Running"
            and p
        ),
        timeout_s=60,
        what="pod Running",
    )
    pid = _pid(pod)
    wait_for(
        lambda: "SIGTERM ignored" in dev_cluster.pod_log(ns, "stubborn", "main"),
        timeout_s=30,
        what="the SIGTERM handler to be installed",
    )
    start = time.monotonic()
    dev_cluster.core.delete_namespaced_pod("stubborn", ns)
    wait_for(lambda: not _alive(pid), timeout_s=30, what="the process to be killed")
    elapsed = time.monotonic() - start
    assert 1.5 <= elapsed < 15, elapsed  # grace 2s, then SIGKILL
    wait_for(
        lambda: not [p for p in _pods(dev_cluster, ns) if p.metadata.name == "stubborn"],
        timeout_s=30,
        what="the pod object to be removed",
    )
