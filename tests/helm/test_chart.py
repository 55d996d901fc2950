"""The chart offline: helm lint --strict, helm template with the default values and each
ci/*.yaml, the schema refusing bad values with the key named, the RBAC staying least privilege,
the env matching OperatorSettings one to one, the CRDs matching crds/, and the images and the
kind script agreeing with what the chart and the operator render."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubeinfer import __version__
from kubeinfer.operator.settings import OperatorSettings
from tests.helm.conftest import CHART, CI_VALUES, REPO, Helm

VALUE_SETS = [None, *CI_VALUES]
VALUE_IDS = ["default", *(p.stem for p in CI_VALUES)]


def _values_args(values: Path | None) -> list[str]:
    return ["-f", str(values)] if values else []


def _kinds(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def _is_hook(obj: dict[str, Any]) -> bool:
    return "helm.sh/hook" in (obj["metadata"].get("annotations") or {})


def _release(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The release's own objects (not the helm test hooks)."""
    return [o for o in objs if not _is_hook(o)]


def _operator_deployment(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = _kinds(objs, "Deployment")
    return dep


def _env(dep: dict[str, Any]) -> dict[str, Any]:
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_ci_values_exist() -> None:
    assert len(CI_VALUES) >= 3, CI_VALUES


@pytest.mark.parametrize("values", VALUE_SETS, ids=VALUE_IDS)
def test_lint_strict(helm: Helm, values: Path | None) -> None:
    out = helm.check("lint", "--strict", str(CHART), "--kube-version", helm.kube_version,
                     *_values_args(values))  # fmt: skip
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("values", VALUE_SETS, ids=VALUE_IDS)
def test_template_renders_valid_objects(helm: Helm, values: Path | None) -> None:
    objs = helm.template(*_values_args(values))
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "ServiceAccount" if "minimal" not in str(values) else "Pod"} <= kinds
    for obj in objs:
        meta = obj["metadata"]
        assert len(meta["name"]) <= 63, meta["name"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", meta["name"]), meta["name"]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert meta["labels"]["app.kubernetes.io/part-of"] == "kubeinfer"


@pytest.mark.parametrize("values", VALUE_SETS, ids=VALUE_IDS)
def test_operator_deployment_is_locked_down(helm: Helm, values: Path | None) -> None:
    dep = _operator_deployment(helm.template(*_values_args(values)))
    spec = dep["spec"]
    if values is not None and "leaderElection" in values.read_text():  # one acts, on a Lease
        assert spec["replicas"] == 2 and spec["strategy"] == {"type": "RollingUpdate"}
    else:
        assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    assert c["command"] == ["kubeinfer", "operator", "run"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert {p["name"] for p in c["ports"]} == {"healthz", "metrics"}
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}
    # the pod template carries the selector, and the selector picks only the operator
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert spec["selector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"


def _settings_from_env(env: dict[str, Any]) -> OperatorSettings:
    pod_ip = "127.1.0.7"  # a dev pod IP; only substituted into the env, never dialed
    plain = {
        k: str(v).replace("$(POD_IP)", pod_ip)
        for k, v in env.items()
        if k.startswith("KUBEINFER_OPERATOR_")
    }
    saved = {k: v for k, v in os.environ.items() if k.startswith("KUBEINFER_OPERATOR_")}
    try:
        for k in saved:
            del os.environ[k]
        os.environ.update(plain)
        return OperatorSettings()
    finally:
        for k in plain:
            os.environ.pop(k, None)
        os.environ.update(saved)


def test_env_maps_every_operator_setting_one_to_one(helm: Helm) -> None:
    env = _env(_operator_deployment(helm.template()))
    expected = {f"KUBEINFER_OPERATOR_{name.upper()}" for name in OperatorSettings.model_fields}
    assert {k for k in env if k.startswith("KUBEINFER_OPERATOR_")} == expected
    settings = _settings_from_env(env)
    assert settings.runtime_image == f"kubeinfer/runtime:{__version__}"
    assert settings.is_clusterwide
    assert settings.liveness_host == settings.metrics_host == "127.1.0.7"
    # the chart's defaults are the operator's defaults
    defaults = OperatorSettings()
    for name in OperatorSettings.model_fields:
        if name not in ("liveness_host", "metrics_host", "leader_election_namespace"):
            assert getattr(settings, name) == getattr(defaults, name), name


def test_env_carries_changed_values(helm: Helm) -> None:
    env = _env(_operator_deployment(helm.template("-f", str(CHART / "ci/namespaced-values.yaml"))))
    settings = _settings_from_env(env)
    assert settings.namespaces == ["models", "team-a"]
    assert settings.peering and settings.peering_name == "kubeinfer-models"
    assert settings.priority == 10
    assert settings.log_level == "debug"
    assert settings.pod_probe_interval_s == 2.5
    assert settings.startup_budget_s == 600
    assert settings.runtime_image == "registry.example.com/kubeinfer/runtime:0.1.0-cuda12"
    assert env["EXTRA"] == "1"


def _rules(obj: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples of a Role or ClusterRole."""
    return [
        (group, resource, verb)
        for rule in obj["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    ]


@pytest.mark.parametrize("values", VALUE_SETS, ids=VALUE_IDS)
def test_rbac_has_no_wildcards_and_no_secrets(helm: Helm, values: Path | None) -> None:
    objs = helm.template(*_values_args(values))
    for role in [*_kinds(objs, "Role"), *_kinds(objs, "ClusterRole")]:
        for group, resource, verb in _rules(role):
            assert "*" not in (group, resource, verb), role["metadata"]["name"]
            assert resource not in ("secrets", "configmaps"), role["metadata"]["name"]
            assert verb not in ("escalate", "bind", "impersonate", "deletecollection")


def test_clusterwide_rbac(helm: Helm) -> None:
    objs = _release(helm.template())
    assert not _kinds(objs, "Role")
    (role,) = _kinds(objs, "ClusterRole")
    rules = set(_rules(role))
    assert ("kubeinfer.dev", "inferencemodels/scale", "patch") in rules
    assert ("apps", "deployments/scale", "patch") in rules
    assert ("", "events", "create") in rules
    assert ("", "pods", "watch") in rules
    assert ("apps", "replicasets", "watch") in rules  # pods are matched through their owners
    assert ("", "pods", "delete") not in rules
    # a model's router (its Deployment, ServiceAccount, Role, RoleBinding) goes when the
    # model leaves routing mode router; the operator grants the router pods get/list/watch only
    assert ("apps", "deployments", "delete") in rules
    for resource in ("serviceaccounts", "roles", "rolebindings"):
        group = "" if resource == "serviceaccounts" else "rbac.authorization.k8s.io"
        assert {(group, resource, v) for v in ("create", "patch", "delete")} <= rules
    assert not any(r[2] in ("bind", "escalate") for r in rules)
    assert ("", "namespaces", "list") not in rules  # kopf lists them only when namespaced
    assert not any(r[0] == "kopf.dev" for r in rules)  # peering is off by default
    (binding,) = _kinds(objs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (sa,) = _kinds(objs, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "ops"}
    ]


def test_namespaced_rbac(helm: Helm) -> None:
    objs = _release(helm.template("-f", str(CHART / "ci/namespaced-values.yaml")))
    roles = {r["metadata"]["namespace"]: r for r in _kinds(objs, "Role")}
    assert set(roles) == {"models", "team-a"}
    for role in roles.values():
        rules = set(_rules(role))
        assert ("kubeinfer.dev", "inferencemodels/status", "patch") in rules
        assert ("kopf.dev", "kopfpeerings", "patch") in rules
    bindings = {b["metadata"]["namespace"] for b in _kinds(objs, "RoleBinding")}
    assert bindings == {"models", "team-a"}
    (cluster_role,) = _kinds(objs, "ClusterRole")
    cluster_rules = set(_rules(cluster_role))
    # cluster-wide: only what kopf reads to follow CRDs and namespaces
    assert {r[1] for r in cluster_rules} == {"customresourcedefinitions", "namespaces"}
    assert {r[2] for r in cluster_rules} == {"get", "list", "watch"}


def test_clusterwide_peering_grants_cluster_peerings(helm: Helm) -> None:
    objs = _release(helm.template("-f", str(CHART / "ci/monitoring-values.yaml")))
    (role,) = _kinds(objs, "ClusterRole")
    assert ("kopf.dev", "clusterkopfpeerings", "create") in set(_rules(role))


def test_minimal_values_bring_your_own_account(helm: Helm) -> None:
    objs = _release(helm.template("-f", str(CHART / "ci/minimal-values.yaml")))
    kinds = {o["kind"] for o in objs}
    assert not kinds & {"ServiceAccount", "Role", "ClusterRole", "ClusterRoleBinding", "Service"}
    dep = _operator_deployment(objs)
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "platform-operator"
    assert len(dep["metadata"]["name"]) <= 63
    assert dep["metadata"]["name"].startswith("kubeinfer-operator-with-a-very-long-name")
    assert not dep["metadata"]["name"].endswith("-")


def test_monitoring_values(helm: Helm) -> None:
    objs = _release(helm.template("-f", str(CHART / "ci/monitoring-values.yaml")))
    monitors = {o["metadata"]["name"]: o for o in _kinds(objs, "ServiceMonitor")}
    assert set(monitors) == {"ki-kubeinfer-operator"}
    assert monitors["ki-kubeinfer-operator"]["metadata"]["labels"]["release"] == "prometheus"
    # the models' pods as pods: a model's Service selects its router pods in routing mode
    # router, so a ServiceMonitor on it would never see the runtime's vllm:* metrics
    pod_monitors = {o["metadata"]["name"]: o for o in _kinds(objs, "PodMonitor")}
    assert set(pod_monitors) == {"ki-kubeinfer-runtime", "ki-kubeinfer-router"}
    for component in ("runtime", "router"):
        spec = pod_monitors[f"ki-kubeinfer-{component}"]["spec"]
        assert spec["selector"]["matchLabels"]["app.kubernetes.io/name"] == f"kubeinfer-{component}"
        assert spec["namespaceSelector"] == {"any": True}
        (endpoint,) = spec["podMetricsEndpoints"]
        assert endpoint["port"] == "http" and endpoint["relabelings"][0]["targetLabel"] == "model"
        assert pod_monitors[f"ki-kubeinfer-{component}"]["metadata"]["labels"]["release"] == (
            "prometheus"
        )
    (dashboard,) = _kinds(objs, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dashboard["data"]["kubeinfer.json"])
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p.get("targets", []))
    for metric in (
        "vllm:generation_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "kubeinfer_router_requests_total",
        "kubeinfer_router_decisions_total",
        "kubeinfer_router_held_requests",
        "kubeinfer_router_hold_seconds_bucket",
    ):
        assert metric in exprs, metric
    titles = {p["title"] for p in board["panels"]}
    assert any("Replicas" in t for t in titles)


def test_default_values_make_no_monitoring_objects(helm: Helm) -> None:
    kinds = {o["kind"] for o in _release(helm.template())}
    assert "ServiceMonitor" not in kinds and "PodMonitor" not in kinds
    assert "ConfigMap" not in kinds
    assert "Service" in kinds


def test_helm_test_pod(helm: Helm) -> None:
    hooks = [o for o in helm.template() if _is_hook(o)]
    assert {o["kind"] for o in hooks} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "Pod",
    }
    for o in hooks:
        assert o["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert "hook-succeeded" in o["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
    (pod,) = [o for o in hooks if o["kind"] == "Pod"]
    (cm,) = [o for o in hooks if o["kind"] == "ConfigMap"]
    script = (CHART / "files" / "check_operator.py").read_text()
    assert cm["data"]["check_operator.py"] == script.rstrip("\n")
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert "app.kubernetes.io/component=operator" in env["OPERATOR_SELECTOR"]
    (role,) = [o for o in hooks if o["kind"] == "Role"]
    assert _rules(role) == [("", "pods", "get"), ("", "pods", "list")]


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["--set", "operatorr.logLevel=info"], "operatorr"),
        (["--set", "operator.logLevel=verbose"], "/operator/logLevel"),
        (["--set", "operator.livenessPort=70000"], "/operator/livenessPort"),
        (["--set", "operator.metricsPort=http"], "/operator/metricsPort"),
        (["--set", "watchNamespaces[0]=Bad_Namespace"], "/watchNamespaces/0"),
        (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
        (["--set", "runtime.startupBudgetSeconds=10"], "/runtime/startupBudgetSeconds"),
        (["--set-string", "peering.enabled=yes"], "/peering/enabled"),
        (["--set", "runtime.shmSize=lots"], "/runtime/shmSize"),
        (["--set", "metrics.serviceMonitor.interval=often"], "/metrics/serviceMonitor/interval"),
        (["--set", "serviceAccount.unknown=1"], "unknown"),
    ],
    ids=lambda v: v if isinstance(v, str) else v[1],
)
def test_schema_rejects_bad_values(helm: Helm, args: list[str], key: str) -> None:
    done = helm.run("template", "ki", str(CHART), "--kube-version", helm.kube_version, *args)
    assert done.returncode != 0, done.stdout[:500]
    assert "schema" in done.stderr, done.stderr
    assert key in done.stderr, done.stderr


def test_every_values_key_is_documented() -> None:
    """values.yaml has a comment right above each of the chart's own keys (the keys inside
    Kubernetes objects passed through, like resources or securityContext, excepted), and the
    schema knows every key."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, dict[str, Any] | None]] = [(-1, schema)]
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z]\w*):", line)
        if not match:
            continue
        indent, key = len(match.group(1)), match.group(2)
        while stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        own = parent is not None and parent.get("additionalProperties") is False
        if own:
            assert key in parent["properties"], f"values.yaml line {i + 1}: {key} not in schema"
            assert lines[i - 1].strip().startswith("#"), (
                f"values.yaml line {i + 1} ({key}) has no comment above it"
            )
        stack.append((indent, parent["properties"].get(key) if own else None))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) | {"global"} == set(schema["properties"])


def test_chart_crds_equal_the_top_level_crds() -> None:
    top = {p.name: p.read_bytes() for p in (REPO / "crds").glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert top, "no CRDs in crds/"
    assert chart.keys() == top.keys()
    for name in top:
        assert chart[name] == top[name], f"helm/kubeinfer/crds/{name} differs from crds/{name}"


def test_versions_agree() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert chart["appVersion"] == pyproject["project"]["version"] == __version__
    assert chart["kubeVersion"].startswith(">=1.29")


def test_dockerfiles_match_what_is_rendered() -> None:
    runtime = (REPO / "docker" / "runtime.Dockerfile").read_text()
    operator = (REPO / "docker" / "operator.Dockerfile").read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+", runtime, re.MULTILINE)
    assert 'pip install ".[runtime,gpu]"' in runtime
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert {"runtime", "gpu"} <= set(extras)
    # the operator image installs the core alone: no torch (tests/test_packaging.py proves the
    # operator runs without it)
    assert re.search(r"pip install \.(\s|$)", operator)
    assert "torch" not in operator.split("RUN", 1)[1].split("USER", 1)[0]
    assert 'ENTRYPOINT ["kubeinfer", "serve"]' in runtime
    # both images build the distribution: every folder it maps, and setup.py, are copied in
    folders = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"][
        "setuptools"
    ]["package-dir"].values()
    for text in (runtime, operator):
        assert re.search(r"^COPY pyproject\.toml setup\.py README\.md \./$", text, re.MULTILINE)
        for folder in folders:
            assert re.search(rf"^COPY {folder}/ {folder}/$", text, re.MULTILINE), folder
    assert re.search(r"^FROM python:3\.\d+-slim", operator, re.MULTILINE)
    assert 'ENTRYPOINT ["kubeinfer", "operator", "run"]' in operator
    # the uid the pods run as (operator/manifests.py, the chart's podSecurityContext)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    uid = values["podSecurityContext"]["runAsUser"]
    for text in (runtime, operator):
        assert re.search(rf"^USER {uid}:{uid}$", text, re.MULTILINE)


def _run_e2e_kind(tmp_path: Path, stubs: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """hack/e2e-kind.sh with a PATH of only the basics and `stubs` (each exits 1)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "sed", "dirname", "cat"):
        for folder in ("/usr/bin", "/bin"):
            if Path(folder, tool).exists():
                (bin_dir / tool).symlink_to(Path(folder, tool))
                break
    for stub in stubs:
        (bin_dir / stub).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / stub).chmod(0o755)
    return subprocess.run(
        [str(bin_dir / "bash"), str(REPO / "hack" / "e2e-kind.sh")],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_e2e_kind_refuses_clearly_without_docker(tmp_path: Path) -> None:
    """No Docker or kind on PATH: a clear message naming them, before anything slow."""
    done = _run_e2e_kind(tmp_path, stubs=("kubectl", "helm"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "needs docker kind on PATH" in done.stderr, done.stderr
    assert "cannot run" in done.stderr
    assert "-->" not in done.stdout  # nothing started


def test_e2e_kind_refuses_clearly_without_a_docker_daemon(tmp_path: Path) -> None:
    done = _run_e2e_kind(tmp_path, stubs=("docker", "kind", "kubectl", "helm"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "daemon does not answer" in done.stderr, done.stderr
    assert "-->" not in done.stdout


def test_two_replicas_need_leader_election(helm: Helm) -> None:
    refused = helm.run("template", str(CHART), "--set", "replicaCount=2",
                       "--kube-version", helm.kube_version)  # fmt: skip
    assert refused.returncode != 0 and "leaderElection.enabled" in refused.stderr
    objs = helm.template("--set", "replicaCount=2", "--set", "leaderElection.enabled=true")
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KUBEINFER_OPERATOR_LEADER_ELECTION"]["value"] == "true"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    roles = [o for o in objs if o["kind"] == "Role" and any(
        "leases" in r["resources"] for r in o["rules"])]  # fmt: skip
    assert len(roles) == 1 and roles[0]["rules"][0]["verbs"] == ["get", "create", "update"]


def test_template_needs_no_kube_version(helm: Helm) -> None:
    """The bundled helm knows a current Kubernetes (its build sets the kube-version ldflags,
    as helm's own Makefile does): without them it assumed v1.20, below the chart's
    kubeVersion, and `helm template` failed unless given --kube-version."""
    done = helm.run("template", "kubeinfer", str(CHART))
    assert done.returncode == 0, done.stderr
