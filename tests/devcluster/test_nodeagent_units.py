"""The node agent's pure parts: expansion, pod spec translation, probes, status, IPs, backoff."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from kubeinfer.devcluster.components import COMPONENTS, Layout, Ports, command_line
from kubeinfer.devcluster.config import AgentConfig, default_image_mappings
from kubeinfer.devcluster.credentials import render_kubeconfig
from kubeinfer.devcluster.nodeagent import podstatus
from kubeinfer.devcluster.nodeagent.container import backoff_delay, should_restart
from kubeinfer.devcluster.nodeagent.expand import expand
from kubeinfer.devcluster.nodeagent.ipam import Ipam, IpamExhaustedError
from kubeinfer.devcluster.nodeagent.podspec import (
    PodContext,
    PodSpecError,
    launch_spec,
    resolve_image,
    resource_field_ref,
    rewrite_paths,
)
from kubeinfer.devcluster.nodeagent.probes import ProbeResult, ProbeTracker, resolve_port


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)", "1"),
        ("x$(A)y$(B)z", "x1y2z"),
        ("$(MISSING)", "$(MISSING)"),
        ("$$(A)", "$(A)"),
        ("$$", "$"),
        ("$A", "$A"),
        ("$(A", "$(A"),
        ("tail$", "tail$"),
        ("--bind=$(POD_IP):8080", "--bind=127.1.0.9:8080"),
    ],
)
def test_expand_follows_kubelet_rules(text: str, expected: str) -> None:
    assert expand(text, {"A": "1", "B": "2", "POD_IP": "127.1.0.9"}) == expected


def _pod(**spec: Any) -> dict[str, Any]:
    container = {
        "name": "main",
        "image": "python:3.11-slim",
        "command": ["python3", "-m", "http.server", "8080", "--bind", "$(POD_IP)"],
        "args": ["--directory", "/data/site"],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "GREETING", "value": "hi $(POD_NAME) in $(NS)"},
            {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
            {
                "name": "MEM",
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
            },
            {"name": "DATA", "value": "/data"},
        ],
        "volumeMounts": [{"name": "site", "mountPath": "/data"}],
        "resources": {"limits": {"memory": "64Mi"}},
    }
    container.update(spec.pop("container", {}))
    return {
        "metadata": {"name": "web-1", "namespace": "ns1", "uid": "u1", "labels": {"app": "web"}},
        "spec": {
            "nodeName": "dev-gpu-0",
            "containers": [container],
            "volumes": [{"name": "site", "hostPath": {"path": "/srv/site"}}],
            **spec,
        },
    }


def _ctx(tmp_path: Path) -> PodContext:
    return PodContext(
        pod_ip="127.1.0.9",
        host_ip="127.0.0.1",
        api_host="127.0.0.1",
        api_port=6443,
        pod_dir=tmp_path,
        kubeconfig=tmp_path / "kubeconfig",
        venv_bin=Path("/repo/.venv/bin"),
        agent_path="/repo/.venv/bin:/usr/local/bin:/usr/bin",
    )


def _lookup(kind: str, namespace: str, name: str) -> dict[str, str] | None:
    return (
        {"k": "from-configmap"} if (kind, namespace, name) == ("ConfigMap", "ns1", "cm") else None
    )


def test_launch_spec_resolves_env_expands_and_rewrites_mounts(tmp_path: Path) -> None:
    pod = _pod()
    spec = launch_spec(
        pod, pod["spec"]["containers"][0], _ctx(tmp_path), default_image_mappings(), _lookup
    )
    assert spec.argv == [
        "python3",
        "-m",
        "http.server",
        "8080",
        "--bind",
        "127.1.0.9",
        "--directory",
        "/srv/site/site",
    ]
    env = spec.env
    assert env["POD_IP"] == "127.1.0.9" and env["POD_NAME"] == "web-1" and env["NS"] == "ns1"
    assert env["APP"] == "web" and env["GREETING"] == "hi web-1 in ns1"
    assert env["FROM_CM"] == "from-configmap" and env["MEM"] == "64"
    assert env["DATA"] == "/srv/site"
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1" and env["KUBECONFIG"].endswith(
        "kubeconfig"
    )
    # python:* runs the machine's Python: the project venv is not on its PATH
    assert "/repo/.venv/bin" not in env["PATH"].split(":")


def test_runtime_image_runs_with_the_project_venv(tmp_path: Path) -> None:
    pod = _pod(
        container={
            "image": "kubeinfer/runtime:dev",
            "command": None,
            "args": ["serve", "--host", "$(POD_IP)"],
        }
    )
    spec = launch_spec(
        pod, pod["spec"]["containers"][0], _ctx(tmp_path), default_image_mappings(), _lookup
    )
    assert spec.argv == ["kubeinfer", "serve", "--host", "127.1.0.9"]  # the image's entrypoint
    assert spec.env["PATH"].split(":")[0] == "/repo/.venv/bin"


def test_our_images_share_the_nodes_kernel_cache_unless_the_pod_sets_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runtime pods find the CPU kernels this node built (their HOME is an emptyDir, so each
    would compile its own); python:* images get nothing of ours; a pod's own value wins."""
    monkeypatch.setenv("KUBEINFER_CACHE", "/var/cache/ki")
    runtime = _pod(container={"image": "kubeinfer/runtime:dev", "command": None, "args": []})
    spec = launch_spec(
        runtime, runtime["spec"]["containers"][0], _ctx(tmp_path), default_image_mappings(), _lookup
    )
    assert spec.env["KUBEINFER_CACHE"] == "/var/cache/ki"
    plain = _pod()
    spec = launch_spec(
        plain, plain["spec"]["containers"][0], _ctx(tmp_path), default_image_mappings(), _lookup
    )
    assert "KUBEINFER_CACHE" not in spec.env
    own = _pod(
        container={
            "image": "kubeinfer/runtime:dev",
            "command": None,
            "args": [],
            "env": [{"name": "KUBEINFER_CACHE", "value": "/elsewhere"}],
        }
    )
    spec = launch_spec(
        own, own["spec"]["containers"][0], _ctx(tmp_path), default_image_mappings(), _lookup
    )
    assert spec.env["KUBEINFER_CACHE"] == "/elsewhere"


def test_a_tmp_mount_leaves_the_agents_own_paths_alone(tmp_path: Path) -> None:
    """A checkout under /tmp (as CI may clone) and a pod with an emptyDir at /tmp (the
    operator's and the runtime's read-only-root pods): the agent's PATH, VIRTUAL_ENV and
    KUBECONFIG point into the checkout and must not be rewritten; the pod's own values are."""
    pod = _pod(
        container={
            "image": "kubeinfer/operator:dev",
            "command": None,
            "args": ["operator", "run", "--log-dir", "/tmp/logs"],
            "env": [{"name": "CACHE", "value": "/tmp/cache"}],
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        },
        volumes=[{"name": "tmp", "emptyDir": {}}],
    )
    ctx = _ctx(tmp_path)
    ctx.venv_bin = Path("/tmp/ci/.venv/bin")
    ctx.kubeconfig = Path("/tmp/ci/.cache/dev/pods/p/kubeconfig")
    spec = launch_spec(pod, pod["spec"]["containers"][0], ctx, default_image_mappings(), _lookup)
    assert spec.env["PATH"].split(":")[0] == "/tmp/ci/.venv/bin"
    assert spec.env["VIRTUAL_ENV"] == "/tmp/ci/.venv"
    assert spec.env["KUBECONFIG"] == "/tmp/ci/.cache/dev/pods/p/kubeconfig"
    assert not spec.env["CACHE"].startswith("/tmp/cache")  # the pod's own: its emptyDir
    assert spec.env["CACHE"].endswith("/cache") and spec.argv[-1].endswith("/logs")
    assert not spec.argv[-1].startswith("/tmp/logs")


def test_unmapped_image_is_refused_with_a_reason() -> None:
    with pytest.raises(PodSpecError) as err:
        resolve_image("nginx:1.27", default_image_mappings())
    assert err.value.reason == "ImageNotMapped" and "nginx:1.27" in err.value.message


def test_missing_configmap_key_is_a_config_error(tmp_path: Path) -> None:
    pod = _pod(
        container={
            "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k"}}}]
        }
    )
    with pytest.raises(PodSpecError, match="nope"):
        launch_spec(
            pod, pod["spec"]["containers"][0], _ctx(tmp_path), default_image_mappings(), _lookup
        )


def test_rewrite_paths_never_rewrites_a_replacement_again() -> None:
    # a volume's real path lies under /tmp (the agent's state in a /tmp checkout) and the pod
    # also mounts an emptyDir at /tmp: /scripts must become its real path, once
    rewrites = [("/scripts", "/tmp/ci/run/v/scripts"), ("/tmp", "/tmp/ci/run/v/tmp")]
    assert rewrite_paths("/scripts/check.py", rewrites) == "/tmp/ci/run/v/scripts/check.py"
    assert rewrite_paths("/tmp/x /scripts", rewrites) == "/tmp/ci/run/v/tmp/x /tmp/ci/run/v/scripts"


def test_rewrite_paths_only_touches_whole_path_components() -> None:
    rewrites = [("/models", "/real/m")]
    assert rewrite_paths("--model=/models/x", rewrites) == "--model=/real/m/x"
    assert rewrite_paths("/models", rewrites) == "/real/m"
    assert rewrite_paths("/modelsfoo /a/models", rewrites) == "/modelsfoo /a/models"


def test_probe_tracker_thresholds_and_delays() -> None:
    tracker = ProbeTracker(
        "readiness",
        {
            "initialDelaySeconds": 5,
            "periodSeconds": 2,
            "failureThreshold": 2,
            "successThreshold": 2,
        },
        100.0,
    )
    assert not tracker.is_success and not tracker.is_due(104.9) and tracker.is_due(105)
    tracker.record(ProbeResult(True, ""), 105)
    assert not tracker.is_success and tracker.next_due == 107  # needs 2 successes
    tracker.record(ProbeResult(True, ""), 107)
    assert tracker.is_success
    tracker.record(ProbeResult(False, ""), 109)
    assert tracker.is_success  # one failure is below the threshold
    tracker.record(ProbeResult(False, ""), 111)
    assert tracker.has_failed


def test_liveness_starts_passing() -> None:
    assert ProbeTracker("liveness", {}, 0).is_success
    assert not ProbeTracker("readiness", {}, 0).is_success


def test_named_probe_port() -> None:
    container = {"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}
    assert resolve_port("http", container) == 8000 and resolve_port(81, container) == 81
    with pytest.raises(ValueError):
        resolve_port("grpc", container)


def test_restart_policy_and_backoff() -> None:
    assert should_restart("Always", 0) and should_restart("OnFailure", 1)
    assert not should_restart("OnFailure", 0) and not should_restart("Never", 1)
    assert [backoff_delay(n, 1, 10) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]


def test_pod_phase() -> None:
    phase = podstatus.pod_phase
    assert phase(is_initialized=False, num_running=0, num_restarting=0, exit_codes=[None]) == (
        "Pending"
    )
    assert phase(is_initialized=True, num_running=1, num_restarting=0, exit_codes=[None]) == (
        "Running"
    )
    assert phase(is_initialized=True, num_running=0, num_restarting=0, exit_codes=[0, 0]) == (
        "Succeeded"
    )
    assert phase(is_initialized=True, num_running=0, num_restarting=0, exit_codes=[0, 2]) == (
        "Failed"
    )


def test_conditions_keep_transition_times() -> None:
    first = podstatus.conditions(
        [], is_initialized=True, are_containers_ready=False, has_sandbox=True, now="t1"
    )
    second = podstatus.conditions(
        first, is_initialized=True, are_containers_ready=True, has_sandbox=True, now="t2"
    )
    times = {c["type"]: c["lastTransitionTime"] for c in second}
    assert times == {
        "PodReadyToStartContainers": "t1",
        "Initialized": "t1",
        "ContainersReady": "t2",
        "Ready": "t2",
    }


def test_ipam_is_loopback_round_robin_and_bounded() -> None:
    ipam = Ipam("127.1.0.0/30")
    first = ipam.allocate("a")
    assert first.startswith("127.1.") and ipam.allocate("a") == first
    second = ipam.allocate("b")
    with pytest.raises(IpamExhaustedError):
        ipam.allocate("c")
    ipam.release("a")
    assert ipam.allocate("c") == first and second != first
    with pytest.raises(ValueError):
        Ipam("10.1.0.0/16")


def test_components_listen_on_loopback_only(tmp_path: Path) -> None:
    ports = Ports(1, 2, 3, 4, 5)
    for name in COMPONENTS:
        argv = " ".join(command_line(name, tmp_path, Layout(tmp_path), ports))
        assert not re.search(r"(?<![\d.])0\.0\.0\.0", argv)
        for flag in ("--bind-address=", "--listen-client-urls=", "--listen-peer-urls="):
            if flag in argv:
                assert f"{flag}127.0.0.1" in argv or f"{flag}http://127.0.0.1" in argv


def test_kubeconfig_uses_token_and_ca(tmp_path: Path) -> None:
    cfg = render_kubeconfig(server="https://127.0.0.1:1", ca_file=tmp_path / "ca", token="tok")
    assert cfg["users"][0]["user"] == {"token": "tok"}
    assert cfg["clusters"][0]["cluster"]["certificate-authority"] == str(tmp_path / "ca")


def test_agent_config_round_trips(tmp_path: Path) -> None:
    config = AgentConfig(
        kubeconfig=tmp_path / "k", api_port=1, ca_file=tmp_path / "ca", state_dir=tmp_path
    )
    assert AgentConfig.model_validate_json(config.model_dump_json()) == config
    assert config.nodes.node_names() == ["dev-gpu-0", "dev-gpu-1"]


def test_up_without_binaries_says_how_to_build_them(tmp_path: Path) -> None:
    from kubeinfer.devcluster.cluster import DevCluster
    from kubeinfer.devcluster.config import DevClusterError, NodeConfig

    cluster = DevCluster(Layout(tmp_path / "dev"), tmp_path / "no-bin", NodeConfig())
    with pytest.raises(DevClusterError, match="make controlplane"):
        cluster.up()


def test_ipam_offsets_differ_per_cluster_key() -> None:
    """Two dev clusters on one machine start handing out addresses at different places."""
    a = Ipam("127.1.0.0/16", "/work/a/.cache/dev").allocate("pod")
    b = Ipam("127.1.0.0/16", "/tmp/ci/.cache/dev").allocate("pod")
    assert a != b and a.startswith("127.1.") and b.startswith("127.1.")
    assert Ipam("127.1.0.0/16", "/work/a/.cache/dev").allocate("x") == a  # stable per key


def test_resource_field_ref_tells_requests_from_limits() -> None:
    """As the kubelet: requests.cpu is the request (the runtime's OMP_NUM_THREADS), limits.cpu
    the limit, else the node's CPUs; rounded up over the divisor."""
    c = {"resources": {"requests": {"cpu": "1500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}}
    assert resource_field_ref(c, {"resource": "requests.cpu", "divisor": "1"}) == "2"
    assert resource_field_ref(c, {"resource": "limits.cpu"}) == str(os.cpu_count() or 1)
    assert resource_field_ref(c, {"resource": "requests.memory", "divisor": "1Mi"}) == "1024"
    assert resource_field_ref(c, {"resource": "limits.memory", "divisor": "1Mi"}) == "2048"
    only_limit = {"resources": {"limits": {"cpu": "3"}}}  # a request defaults to the limit
    assert resource_field_ref(only_limit, {"resource": "requests.cpu"}) == "3"
