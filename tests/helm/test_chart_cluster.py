"""The chart on the dev cluster: helm install, a model, helm test, helm upgrade, RBAC, uninstall.

One release in a fresh namespace serves one other fresh namespace (watchNamespaces). The
operator runs as a pod through the dev node agent, which hands it a token of the chart's
ServiceAccount: the chart's RBAC is all it has. The tests run in order on that release;
every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kubeinfer.devcluster.testing import DevClusterHandle, wait_for
from kubeinfer.operator.testing import dev_hostpath_helm_args
from tests.helm.conftest import CHART, Helm
from tests.operator.conftest import example_model

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

GROUP, VERSION, PLURAL = "kubeinfer.dev", "v1alpha1", "inferencemodels"
READY_TIMEOUT_S = 300  # SmolLM2 on a shared 2-core machine
OPERATOR_TIMEOUT_S = 120
# The API's refusals as our code, the kubernetes client and kopf log them ("HTTP 403: pods is
# forbidden: ...", "(403) Reason: Forbidden", "Not enough permissions to ..."); a bare 403 would
# also match the milliseconds of a log timestamp.
FORBIDDEN = re.compile(r"forbidden|not enough permissions|HTTP 403|\(403\)|status=403", re.I)


class Release:
    """The release, its namespace, the models' namespace, and helpers."""

    def __init__(self, dev: DevClusterHandle, helm: Helm, ns: str, models_ns: str) -> None:
        self.dev, self.helm, self.ns, self.models_ns = dev, helm, ns, models_ns
        self.name = f"ki-{secrets.token_hex(2)}"
        self.fullname = f"{self.name}-kubeinfer"
        self.custom = client.CustomObjectsApi(dev.api_client)
        self.operator_pods: list[dict[str, Any]] = []  # every one seen, for their logs
        self.manifest: list[dict[str, Any]] = []

    def run(self, *args: str, timeout_s: float = 240) -> str:
        return self.helm.check(*args, "--namespace", self.ns, kubeconfig=self.dev.kubeconfig,
                               timeout_s=timeout_s)  # fmt: skip

    @property
    def service_account(self) -> str:
        return f"system:serviceaccount:{self.ns}:{self.fullname}"

    def pods(self) -> list[dict[str, Any]]:
        selector = f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component=operator"
        pods = self.dev.core.list_namespaced_pod(self.ns, label_selector=selector).items
        return [self.dev.api_client.sanitize_for_serialization(p) for p in pods]

    def ready_operator(self, not_uid: str = "") -> dict[str, Any]:
        """The one operator pod, Ready (and not the one with uid `not_uid`)."""

        def check() -> dict[str, Any] | None:
            pods = [p for p in self.pods() if p["metadata"]["uid"] != not_uid]
            if len(pods) != 1 or not_uid and len(self.pods()) != 1:
                return None
            conditions = pods[0].get("status", {}).get("conditions") or []
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
            return pods[0] if ready else None

        try:
            pod = wait_for(check, timeout_s=OPERATOR_TIMEOUT_S, what="a ready operator pod")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnostics()}") from None
        if pod["metadata"]["uid"] not in {p["metadata"]["uid"] for p in self.operator_pods}:
            self.operator_pods.append(pod)
        return pod

    def log(self, pod: dict[str, Any]) -> str:
        return self.dev.pod_log(self.ns, pod["metadata"]["name"], "operator")

    def model(self, name: str = "smollm2") -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.models_ns, PLURAL, name
        )

    def patch_model(self, patch: dict[str, Any], name: str = "smollm2") -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.models_ns, PLURAL, name, patch,
            _content_type="application/merge-patch+json",
        )  # fmt: skip

    def wait_status(
        self, what: str, check: Any, timeout_s: float, name: str = "smollm2"
    ) -> dict[str, Any]:
        try:
            return wait_for(
                lambda: check(self.model(name).get("status") or {}), timeout_s=timeout_s, what=what
            )
        except AssertionError as exc:
            status = json.dumps(self.model(name).get("status") or {})
            raise AssertionError(f"{exc}\nstatus: {status}\n{self.diagnostics()}") from None

    def diagnostics(self) -> str:
        logs = "\n".join(
            f"--- {p['metadata']['name']} ---\n{self.log(p)[-3000:]}" for p in self.operator_pods
        )
        pods = [(p["metadata"]["name"], p.get("status", {}).get("phase")) for p in self.pods()]
        return f"operator pods: {pods}\n{logs}"


@pytest.fixture(scope="module")
def release(dev_cluster: DevClusterHandle, helm: Helm) -> Iterator[Release]:
    ns, models_ns = dev_cluster.namespace("helm"), dev_cluster.namespace("models")
    r = Release(dev_cluster, helm, ns, models_ns)
    try:
        yield r
    finally:
        # models first, while an operator may still run (an autoscaled one has a finalizer)
        dev_cluster.kubectl("delete", "inferencemodels", "--all", "-n", models_ns,
                            "--wait=false", check=False)  # fmt: skip
        helm.run("uninstall", r.name, "--namespace", ns, "--wait", "--timeout", "60s",
                 kubeconfig=dev_cluster.kubeconfig)  # fmt: skip
        for name in (models_ns, ns):
            dev_cluster.delete_namespace(name)


def test_install_runs_the_operator_as_a_pod_with_the_charts_account(release: Release) -> None:
    release.run(
        "install", release.name, str(CHART),
        "--set", f"watchNamespaces={{{release.models_ns}}}",
        "--set", "operator.podProbeIntervalSeconds=2",
        *dev_hostpath_helm_args(),
        "--wait", "--timeout", "180s",
    )  # fmt: skip
    pod = release.ready_operator()
    assert pod["spec"]["serviceAccountName"] == release.fullname
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "kubeinfer/operator:0.1.0"
    # the node agent's per-pod kubeconfig holds a token of that account, nothing else
    kubeconfig = release.dev.cluster.layout.root / "run" / pod["metadata"]["uid"] / "kubeconfig"
    users = yaml.safe_load(kubeconfig.read_text())["users"]
    assert [u["name"] for u in users] == [release.service_account]
    assert f"namespaces ['{release.models_ns}']" in release.log(pod)
    status = json.loads(release.run("status", release.name, "-o", "json"))
    assert status["info"]["status"] == "deployed"
    assert "kubectl apply" in release.run("get", "notes", release.name)
    release.manifest = [
        d for d in yaml.safe_load_all(release.run("get", "manifest", release.name)) if d
    ]


def test_a_model_applied_afterwards_becomes_ready(release: Release, smollm2_dir: Path) -> None:
    model_file = Path(release.dev.cluster.layout.root) / f"{release.models_ns}-smollm2.json"
    model_file.write_text(json.dumps(example_model(smollm2_dir.resolve(), release.models_ns)))
    release.dev.kubectl("apply", "-f", str(model_file))
    status = release.wait_status(
        "smollm2 Ready",
        lambda s: s if s.get("phase") == "Ready" and s.get("readyReplicas") == 1 else None,
        READY_TIMEOUT_S,
    )
    assert status["endpoint"] == f"http://smollm2.{release.models_ns}.svc:8000/v1"
    # the model's router (routing mode router, the default), made under the chart's role: its
    # ServiceAccount, Role and RoleBinding, and a Ready router pod that lists pods with them
    rbac = client.RbacAuthorizationV1Api(release.dev.api_client)
    role = rbac.read_namespaced_role("smollm2-router", release.models_ns)
    assert [(r.resources, r.verbs) for r in role.rules] == [(["pods"], ["get", "list", "watch"])]
    rbac.read_namespaced_role_binding("smollm2-router", release.models_ns)
    release.dev.core.read_namespaced_service_account("smollm2-router", release.models_ns)

    def router_ready() -> bool:
        pods = release.dev.core.list_namespaced_pod(
            release.models_ns, label_selector="app.kubernetes.io/name=kubeinfer-router"
        ).items
        return any(
            c.type == "Ready" and c.status == "True"
            for p in pods
            for c in p.status.conditions or []
        )

    wait_for(router_ready, timeout_s=60, what="the router pod Ready")


def test_the_operator_scales_and_autoscales_under_the_charts_role(release: Release) -> None:
    """More of the operator's API calls: a PDB made and deleted, the autoscaler's daemon
    (pods, scrapes, status through the status subresource, the model's scale subresource) and
    the Deployment's scale subresource."""
    policy = client.PolicyV1Api(release.dev.api_client)

    def pdb_exists() -> bool:
        try:
            policy.read_namespaced_pod_disruption_budget("smollm2", release.models_ns)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    release.patch_model({"spec": {"replicas": 2}})
    wait_for(pdb_exists, timeout_s=30, what="the PDB of 2 replicas")
    release.patch_model({"spec": {"replicas": 1}})
    wait_for(lambda: not pdb_exists(), timeout_s=30, what="the PDB deleted at 1 replica")
    release.patch_model(
        {"spec": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2,
                                  "scrapeIntervalSeconds": 1, "stableWindowSeconds": 6,
                                  "scaleDownDelaySeconds": 0}}}
    )  # fmt: skip

    def scaling_active(status: dict[str, Any]) -> dict[str, Any] | None:
        conditions = {c["type"]: c for c in status.get("conditions") or []}
        return status if "ScalingActive" in conditions else None

    release.wait_status("the autoscaler's ScalingActive condition", scaling_active, 60)
    # Asked for 2 while idle: the reconciler sets the Deployment through its scale
    # subresource, and the autoscaler brings the model back to 1 through the model's.
    release.patch_model({"spec": {"replicas": 2}})
    apps = release.dev.apps
    wait_for(
        lambda: apps.read_namespaced_deployment("smollm2", release.models_ns).spec.replicas == 2,
        timeout_s=30,
        what="the Deployment scaled to 2",
    )

    def scaled_back(status: dict[str, Any]) -> dict[str, Any] | None:
        history = status.get("scalingHistory") or []
        down = any(h.get("from") == 2 and h.get("to") == 1 for h in history)
        return status if down and release.model()["spec"]["replicas"] == 1 else None

    release.wait_status("the autoscaler scaling back to 1", scaled_back, 90)
    release.wait_status(
        "Ready at 1 replica", lambda s: s if s.get("readyReplicas") == 1 else None, 120
    )


def test_failures_reach_the_status_under_the_charts_role(release: Release) -> None:
    """A spec the API refuses in the Deployment (a Warning event, phase Failed) and weights the
    runtime cannot load (the pod's /ready error in the Ready condition)."""
    cache = Path(os.environ.get("KUBEINFER_CACHE", Path.home() / ".cache" / "kubeinfer"))
    empty = cache / "helm-tests" / release.models_ns / "empty"  # never under /tmp: see
    empty.mkdir(parents=True, exist_ok=True)  # tests/operator/test_operator_cluster.py
    specs = {
        "unservable": {
            "model": {"uri": "pvc://weights"},
            "replicas": 0,
            "scheduling": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
        },
        "empty": {
            "model": {"uri": f"hostpath://{empty}"},
            "runtime": {"extraArgs": ["--device", "cpu", "--num-kv-blocks", "16"]},
            "resources": {"gpus": 0, "cpu": "1", "memory": "1Gi"},
        },
    }
    try:
        for name, spec in specs.items():
            body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceModel",
                    "metadata": {"name": name}, "spec": spec}  # fmt: skip
            release.custom.create_namespaced_custom_object(
                GROUP, VERSION, release.models_ns, PLURAL, body
            )
        expected = {"unservable": "tolerations", "empty": str(empty)}
        for name, text in expected.items():
            status = release.wait_status(
                f"{name} Failed", lambda s: s if s.get("phase") == "Failed" else None,
                READY_TIMEOUT_S, name=name,
            )  # fmt: skip
            ready = next(c for c in status["conditions"] if c["type"] == "Ready")
            assert text in ready["message"], ready
        events = release.dev.core.list_namespaced_event(release.models_ns).items
        assert "InvalidSpec" in {e.reason for e in events if e.involved_object.name == "unservable"}
    finally:
        for name in specs:
            release.custom.delete_namespaced_custom_object(
                GROUP, VERSION, release.models_ns, PLURAL, name
            )
        shutil.rmtree(empty.parent, ignore_errors=True)


def test_helm_test_passes(release: Release) -> None:
    # no --logs: hook-succeeded deletes the pod before helm could read them; the node agent
    # keeps its log file
    out = release.run("test", release.name, "--timeout", "180s", timeout_s=240)
    assert "Phase:          Failed" not in out, out
    assert "Phase:          Succeeded" in out, out
    log = release.dev.pod_log(release.ns, f"{release.fullname}-test", "test")
    assert "OK: operator at" in log, log
    # hook-succeeded: the test pod and its account are gone again
    pods = release.dev.core.list_namespaced_pod(
        release.ns, label_selector="app.kubernetes.io/component=test"
    ).items
    assert not [p for p in pods if not p.metadata.deletion_timestamp]
    accounts = release.dev.core.list_namespaced_service_account(release.ns).items
    assert f"{release.fullname}-test" not in {a.metadata.name for a in accounts}


def test_upgrade_with_changed_values_rolls_the_operator(release: Release) -> None:
    before = release.ready_operator()
    release.run(
        "upgrade", release.name, str(CHART), "--reuse-values",
        "--set", "operator.logLevel=debug",
        "--wait", "--timeout", "180s",
    )  # fmt: skip
    after = release.ready_operator(not_uid=before["metadata"]["uid"])
    (container,) = after["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KUBEINFER_OPERATOR_LOG_LEVEL"] == "debug"
    assert env["KUBEINFER_OPERATOR_NAMESPACES"] == release.models_ns  # values reused
    history = json.loads(release.run("history", release.name, "-o", "json"))
    assert [h["revision"] for h in history] == [1, 2]
    # the new operator serves the model: it repairs a deleted child
    release.dev.core.delete_namespaced_service("smollm2", release.models_ns)
    wait_for(
        lambda: release.dev.core.read_namespaced_service("smollm2", release.models_ns),
        timeout_s=30,
        what="the Service re-applied by the new operator",
    )
    release.wait_status("Ready after the upgrade", lambda s: s.get("phase") == "Ready", 60)


def test_rbac_the_operator_was_never_forbidden(release: Release) -> None:
    assert len(release.operator_pods) == 2
    for pod in release.operator_pods:
        log = release.log(pod)
        assert log, f"no log of {pod['metadata']['name']}"
        hits = [line for line in log.splitlines() if FORBIDDEN.search(line)]
        assert not hits, "\n".join(hits[:20])


@pytest.mark.parametrize(
    ("verb", "resource", "where"),
    [
        ("patch", "inferencemodels.kubeinfer.dev/scale", "models"),
        ("patch", "inferencemodels.kubeinfer.dev/status", "models"),
        ("update", "inferencemodels.kubeinfer.dev/finalizers", "models"),
        ("patch", "deployments.apps/scale", "models"),
        ("create", "deployments.apps", "models"),
        ("delete", "poddisruptionbudgets.policy", "models"),
        ("watch", "pods", "models"),
        ("create", "events", "models"),
        ("watch", "customresourcedefinitions.apiextensions.k8s.io", ""),
        ("list", "namespaces", ""),
    ],
)
def test_rbac_grants_what_the_operator_calls(
    release: Release, verb: str, resource: str, where: str
) -> None:
    resource, _, sub = resource.partition("/")
    ns_args = ["-n", release.models_ns] if where else []
    sub_args = [f"--subresource={sub}"] if sub else []
    out = release.dev.kubectl("auth", "can-i", verb, resource, *sub_args, *ns_args,
                              f"--as={release.service_account}", check=False)  # fmt: skip
    assert out.strip() == "yes", f"{verb} {resource} {sub}: {out}"


@pytest.mark.parametrize(
    "call",
    [
        ["get", "secrets", "-n", "{models}"],
        ["get", "secrets", "-n", "{ns}"],
        ["get", "configmaps", "-n", "{models}"],
        ["get", "pods", "-n", "kube-system"],
        ["get", "deployments", "-n", "{ns}"],
        # deleting Deployments is allowed (a model leaving routing mode router), pods never
        ["delete", "pods", "--all", "-n", "{models}", "--wait=false"],
        ["delete", "inferencemodel", "smollm2", "-n", "{models}", "--wait=false"],
        ["get", "clusterroles"],
    ],
    ids=lambda c: " ".join(c[:2] + c[3:4]),
)
def test_rbac_a_call_outside_the_role_is_forbidden(release: Release, call: list[str]) -> None:
    """Real calls with a token of the chart's ServiceAccount."""
    token = release.dev.kubectl(
        "create", "token", release.fullname, "-n", release.ns, "--duration=10m"
    ).strip()
    args = [a.format(models=release.models_ns, ns=release.ns) for a in call]
    done = subprocess.run(
        [str(release.dev.kubectl_path), "--kubeconfig", str(release.dev.kubeconfig),
         "--token", token, *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0, done.stdout
    assert "forbidden" in done.stderr.lower(), done.stderr
    assert release.service_account in done.stderr, done.stderr


def test_uninstall_removes_everything_the_chart_made(release: Release) -> None:
    assert release.manifest, "the install test did not record the manifest"
    release.dev.kubectl("delete", "inferencemodel", "smollm2", "-n", release.models_ns,
                        "--timeout=60s")  # fmt: skip
    release.run("uninstall", release.name, "--wait", "--timeout", "120s")
    for obj in release.manifest:
        group = obj["apiVersion"].rpartition("/")[0]
        resource = f"{obj['kind'].lower()}.{group}" if group else obj["kind"].lower()
        ns = obj["metadata"].get("namespace")
        ns_args = ["-n", ns] if ns else []

        name = obj["metadata"]["name"]

        def gone(resource: str = resource, name: str = name, ns_args: list[str] = ns_args) -> bool:
            out = release.dev.kubectl("get", resource, name, *ns_args, "--ignore-not-found",
                                      "-o", "name")  # fmt: skip
            return out.strip() == ""

        wait_for(gone, timeout_s=30, what=f"{obj['kind']} {name} deleted")
    wait_for(lambda: not release.pods(), timeout_s=60, what="the operator pods gone")
    # helm never deletes what crds/ installed (by design): models outlive the chart
    ext = client.ApiextensionsV1Api(release.dev.api_client)
    assert ext.read_custom_resource_definition("inferencemodels.kubeinfer.dev")
