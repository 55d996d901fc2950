"""render(): the Deployment, Service and PDB of an InferenceModel, without a cluster (the
router's children: tests/operator/test_router_manifests.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kubeinfer.operator.manifests import child_id, render, selector_string
from kubeinfer.operator.settings import OperatorSettings
from kubeinfer.operator.spec import InvalidSpecError
from tests.operator.conftest import example_model, make_model

CONFIG = OperatorSettings(allow_hostpath=True, hostpath_prefixes=["/srv/models", "/data"])


def by_kind(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rendered children by child id (the runtime's by kind, the router's `Router<kind>`)."""
    return {child_id(m, m["metadata"]["labels"]["app.kubernetes.io/instance"]): m
            for m in manifests}  # fmt: skip


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def arg(args: list[str], flag: str) -> str:
    """The value of the last occurrence of `flag` (the runtime's CLI takes the last)."""
    return args[len(args) - 1 - args[::-1].index(flag) + 1]


def test_example_renders_the_runtime_contract() -> None:
    model = example_model("/srv/models/smollm2-135m", namespace="ml")
    model["metadata"]["uid"] = "u-1"
    out = by_kind(render(model, CONFIG))
    assert set(out) == {  # one replica: no PDB; routing mode router by default
        "Deployment", "Service",
        "RouterServiceAccount", "RouterRole", "RouterRoleBinding", "RouterDeployment",
    }  # fmt: skip
    dep = out["Deployment"]
    assert dep["metadata"]["name"] == "smollm2" and dep["metadata"]["namespace"] == "ml"
    assert dep["spec"]["replicas"] == 1
    c = container(dep)
    assert c["command"] == ["kubeinfer", "serve"]
    args = c["args"]
    assert arg(args, "--model") == "/models/model"
    assert arg(args, "--served-model-name") == "smollm2"
    assert arg(args, "--host") == "$(POD_IP)" and arg(args, "--port") == "8000"
    assert arg(args, "--dtype") == "float32"
    assert arg(args, "--max-model-len") == "2048"
    assert arg(args, "--max-num-seqs") == "16"
    assert arg(args, "--max-num-batched-tokens") == "2048"
    assert arg(args, "--kv-cache-memory-fraction") == "0.9"
    assert "--enable-prefix-caching" in args
    assert args[-4:] == ["--device", "cpu", "--num-kv-blocks", "256"]  # extraArgs last
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # torch's threads follow the CPU request, not the node's cores
    assert env["OMP_NUM_THREADS"]["valueFrom"] == {
        "resourceFieldRef": {"containerName": "runtime", "resource": "requests.cpu", "divisor": "1"}
    }
    assert c["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "probes", "containerPort": 8001, "protocol": "TCP"},
    ]
    assert arg(args, "--probe-port") == "8001"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == "probes"  # answers while the API port is flooded
    # a load that hangs never turns /ready 200: the startup probe restarts it after the budget
    assert c["startupProbe"]["httpGet"] == {"path": "/ready", "port": "probes"}
    budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert budget >= 1800  # weights may take many minutes
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["resources"]["requests"] == {"cpu": "1", "memory": "2Gi", "nvidia.com/gpu": "1"}
    assert c["image"] == CONFIG.runtime_image
    pod = dep["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["hostPath"] == {"path": "/srv/models/smollm2-135m", "type": "Directory"}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models/model", "readOnly": True}
    assert mounts["dshm"]["mountPath"] == "/dev/shm"
    # zero downtime by default: a new pod is Ready before an old one goes
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]


@pytest.mark.parametrize(
    ("rollout", "expected"),
    [
        ({"maxSurge": 0, "maxUnavailable": 1}, {"maxSurge": 0, "maxUnavailable": 1}),
        ({"maxSurge": "25%"}, {"maxSurge": "25%", "maxUnavailable": 0}),
        ({"maxUnavailable": "50%", "maxSurge": 2}, {"maxSurge": 2, "maxUnavailable": "50%"}),
    ],
)
def test_rollout_bounds_come_from_the_spec(
    rollout: dict[str, Any], expected: dict[str, Any]
) -> None:
    spec = {"model": {"uri": "pvc://w"}, "rollout": rollout}
    dep = by_kind(render(make_model(spec), CONFIG))["Deployment"]
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": expected}


@pytest.mark.parametrize(
    "rollout",
    [{"maxSurge": 0}, {"maxSurge": "0%", "maxUnavailable": "0%"}, {"maxSurge": "x"},
     {"maxUnavailable": -1}],
)  # fmt: skip
def test_rollouts_that_cannot_progress_are_refused(rollout: dict[str, Any]) -> None:
    with pytest.raises(InvalidSpecError, match="spec.rollout"):
        render(make_model({"model": {"uri": "pvc://w"}, "rollout": rollout}), CONFIG)


@pytest.mark.parametrize("delay", [0, 1, 2, 3, 5, 8, 30, 300])
def test_a_terminating_pod_turns_unready_within_its_shutdown_delay(delay: int) -> None:
    """On SIGTERM the runtime serves `--shutdown-delay` more seconds with /ready failing:
    the readiness probe must mark it unready within that (less a second for the status to
    travel), or a client that picks ready pods sends it work it then refuses."""
    config = OperatorSettings(shutdown_delay_s=delay)
    c = container(by_kind(render(make_model(), config))["Deployment"])
    probe = c["readinessProbe"]
    window = probe["periodSeconds"] * probe["failureThreshold"]
    assert probe["failureThreshold"] >= 1
    assert window <= max(delay - 1, probe["periodSeconds"])
    assert arg(c["args"], "--shutdown-delay") == str(delay)


@pytest.mark.parametrize(("delay", "drain"), [(5, 30), (0, 0), (60, 600)])
def test_grace_period_covers_every_shutdown_timeout(delay: int, drain: int) -> None:
    """The runtime's SIGTERM sequence (shutdown delay + drain + its exit) fits the grace
    period, read from the rendered manifest and the runtime's own settings parser."""
    from kubeinfer.runtime.server.serve import shutdown_bound_s
    from kubeinfer.runtime.server.settings import ServerSettings

    config = OperatorSettings(shutdown_delay_s=delay, drain_timeout_s=drain)
    pod = by_kind(render(make_model(), config))["Deployment"]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    settings = ServerSettings(
        model=arg(args, "--model"),
        shutdown_delay=float(arg(args, "--shutdown-delay")),
        drain_timeout=float(arg(args, "--drain-timeout")),
    )
    assert (settings.shutdown_delay, settings.drain_timeout) == (delay, drain)
    assert shutdown_bound_s(settings) < pod["terminationGracePeriodSeconds"]


def test_security_context_is_locked_down() -> None:
    dep = by_kind(render(make_model(), CONFIG))["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    sc = container(dep)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"] for m in container(dep)["volumeMounts"]}
    assert "/tmp" in mounts  # the only writable place with a read-only root


def test_children_are_owned_and_labelled() -> None:
    model = make_model(uid="the-uid")
    for manifest in render(model, CONFIG):
        meta = manifest["metadata"]
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "kubeinfer.dev/v1alpha1",
                "kind": "InferenceModel",
                "name": "smollm2",
                "uid": "the-uid",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"]["app.kubernetes.io/instance"] == "smollm2"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kubeinfer"
    model["spec"]["routing"] = {"mode": "service"}
    svc = by_kind(render(model, CONFIG))["Service"]
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    assert selector_string("smollm2") == ",".join(
        f"{k}={v}" for k, v in sorted(svc["spec"]["selector"].items())
    )


def test_pdb_only_with_more_than_one_replica() -> None:
    one = by_kind(render(make_model({"model": {"uri": "pvc://w"}, "replicas": 1}), CONFIG))
    three = by_kind(render(make_model({"model": {"uri": "pvc://w"}, "replicas": 3}), CONFIG))
    assert "PodDisruptionBudget" not in one
    pdb = three["PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == three["Deployment"]["spec"]["selector"]


def test_autoscaling_leaves_replicas_out() -> None:
    spec = {"model": {"uri": "pvc://w"}, "replicas": 3, "autoscaling": {"enabled": True}}
    dep = by_kind(render(make_model(spec), CONFIG))["Deployment"]
    assert "replicas" not in dep["spec"]


@pytest.mark.parametrize(
    ("uri", "volume", "model_arg"),
    [
        ("pvc://weights", {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
         "/models"),
        ("pvc://weights/llama/8b", {"persistentVolumeClaim": {"claimName": "weights",
                                                              "readOnly": True}},
         "/models/llama/8b"),
        ("hostpath:///data/m", {"hostPath": {"path": "/data/m", "type": "Directory"}},
         "/models/model"),
        ("hf://HuggingFaceTB/SmolLM2-135M-Instruct", {"emptyDir": {}}, "/models/model"),
    ],
)  # fmt: skip
def test_model_sources(uri: str, volume: dict[str, Any], model_arg: str) -> None:
    dep = by_kind(render(make_model({"model": {"uri": uri}}), CONFIG))["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    model_volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert {k: v for k, v in model_volume.items() if k != "name"} == volume
    assert arg(container(dep)["args"], "--model") == model_arg
    if uri.startswith("hf://"):
        (init,) = pod["initContainers"]
        assert "HuggingFaceTB/SmolLM2-135M-Instruct" in init["command"][-1]
        assert init["image"] == CONFIG.downloader_image
    else:
        assert "initContainers" not in pod


def test_spec_options_reach_the_pod() -> None:
    spec = {
        "model": {"uri": "pvc://w", "servedName": "llama-8b"},
        "runtime": {
            "image": "registry.example/runtime:1.2",
            "enablePrefixCaching": False,
            "env": [{"name": "A", "value": "1"}, {"name": "B", "valueFrom": {"fieldRef": {}}}],
        },
        "resources": {"gpus": 2, "gpuResourceName": "amd.com/gpu", "cpu": 8, "memory": "64Gi"},
        "scheduling": {
            "nodeSelector": {"pool": "h100"},
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            "affinity": {"nodeAffinity": {"x": 1}},
            "priorityClassName": "inference",
            "runtimeClassName": "nvidia",
        },
        "apiKeySecretRef": {"name": "keys", "key": "smollm2"},
    }
    dep = by_kind(render(make_model(spec), CONFIG))["Deployment"]
    pod, c = dep["spec"]["template"]["spec"], container(dep)
    assert c["image"] == "registry.example/runtime:1.2"
    assert arg(c["args"], "--served-model-name") == "llama-8b"
    assert arg(c["args"], "--device") == "cuda"
    assert "--no-enable-prefix-caching" in c["args"]
    assert c["resources"]["limits"]["amd.com/gpu"] == "2"
    assert c["resources"]["requests"]["cpu"] == "8"
    env = {e["name"]: e for e in c["env"]}
    assert env["A"] == {"name": "A", "value": "1"}
    assert "OMP_NUM_THREADS" in env
    spec["runtime"]["env"].append({"name": "OMP_NUM_THREADS", "value": "3"})  # the user's wins
    c = container(by_kind(render(make_model(spec), CONFIG))["Deployment"])
    assert [e for e in c["env"] if e["name"] == "OMP_NUM_THREADS"] == [
        {"name": "OMP_NUM_THREADS", "value": "3"}
    ]
    assert env["KUBEINFER_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "keys", "key": "smollm2"}
    }
    assert pod["nodeSelector"] == {"pool": "h100"}
    assert pod["tolerations"][0] == {"key": "dedicated", "operator": "Exists"}
    assert pod["affinity"] == {"nodeAffinity": {"x": 1}}
    assert pod["priorityClassName"] == "inference"
    assert pod["runtimeClassName"] == "nvidia"


def test_cpu_only_model_has_no_gpu_limit() -> None:
    spec = {"model": {"uri": "pvc://w"}, "resources": {"gpus": 0}}
    c = container(by_kind(render(make_model(spec), CONFIG))["Deployment"])
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert arg(c["args"], "--device") == "cpu"


def test_default_image_comes_from_config() -> None:
    config = OperatorSettings(runtime_image="kubeinfer/runtime:dev")
    c = container(by_kind(render(make_model(), config))["Deployment"])
    assert c["image"] == "kubeinfer/runtime:dev"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"model": {"uri": "s3://bucket/model"}}, "spec.model.uri"),
        ({"model": {"uri": "pvc://w/../etc"}}, "spec.model.uri"),
        ({"model": {"uri": "pvc://w"}, "replicas": -1}, "spec.replicas"),
        ({"model": {"uri": "pvc://w"}, "runtime": {"dtype": "int4"}}, "spec.runtime.dtype"),
        ({}, "spec.model"),
        (
            {"model": {"uri": "pvc://w"}, "autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
            "spec.autoscaling.minReplicas",
        ),
    ],
)
def test_unservable_specs_raise_naming_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpecError, match=field.replace(".", r"\.")):
        render(make_model(spec), CONFIG)
