"""What should exist for one InferenceModel: `render(model, config) -> list[manifest]` (pure).

A Deployment of the runtime (the runtime contract of DESIGN.md: command, POD_IP, probes, GPU
limits and the tensor-parallel size, a read-only model volume, a memory-backed /dev/shm for the
ranks' worker processes, a locked-down security context, a zero-downtime rollout by
default, SIGTERM timings and grace period in step with the readiness probe), a Service (port
8000, named http: the model's endpoint), when more than one replica is asked for, a
PodDisruptionBudget, and in routing mode `router` (the default) the model's router
(`router_manifests.py`), which the Service then selects instead of the runtime pods; in mode
`inferencePool` an InferencePool of the runtime pods (`render_inference_pool`) beside the plain
Service. Each is owned by the model (controller owner reference), so deleting the model garbage-
collects them. When autoscaling is on the Deployment carries no `replicas`: the reconciler sets
it through the Deployment's scale subresource instead, so that the applied object never fights
the scaling writer over that one field.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from kubeinfer.operator.settings import OperatorSettings
from kubeinfer.operator.spec import (
    InferenceModelSpec,
    InvalidSpecError,
    ModelSource,
    check_hostpath,
    parse_model_uri,
    parse_spec,
)

Manifest = dict[str, Any]

GROUP = "kubeinfer.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceModel"
PLURAL = "inferencemodels"
PORT = 8000
#: The runtime's probe port (`--probe-port`): /health, /ready and /metrics on a listener of
#: their own, so the kubelet's probes, the operator's /ready reads and the autoscaler's scrapes
#: answer while the API port is flooded.
PROBE_PORT = 8001
MODELS_ROOT = "/models"
RUNTIME_CONTAINER = "runtime"
MANAGED_BY = "kubeinfer"
APP_NAME = "kubeinfer-runtime"
ROUTER_APP_NAME = "kubeinfer-router"
#: Label keys; the selector is APP_NAME + the model's name.
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
#: `kubeinfer serve` flags the operator sets and `spec.runtime.extraArgs` must not: the address
#: and ports the probes, Services and the autoscaler rely on, the model and its name, the API
#: key (from apiKeySecretRef only), the SIGTERM timings the grace period is computed from, the
#: tensor-parallel size (from spec.runtime.tensorParallelSize, which the CRD checks against
#: resources.gpus), and the runtime's test hook. The CRD refuses them with a CEL rule (a test
#: keeps both in step).
MANAGED_FLAGS = (
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--probe-port",
    "--api-key",
    "--shutdown-delay",
    "--drain-timeout",
    "--tensor-parallel-size",
    "--metrics-fault-file",
)
#: The downward-API variables the operator sets (`--host $(POD_IP)`) and the managed flags as
#: environment variables (`KUBEINFER_<FLAG>`): spec.runtime.env must not set them. The test
#: hook's variable stays open: the autoscaler's cluster test sets it per pod, and it only
#: fails the model's own /metrics.
TEST_HOOK_FLAG = "--metrics-fault-file"
MANAGED_ENV = (
    "POD_IP",
    "POD_NAME",
    "POD_NAMESPACE",
    *(
        "KUBEINFER_" + f.removeprefix("--").replace("-", "_").upper()
        for f in MANAGED_FLAGS
        if f != TEST_HOOK_FLAG
    ),
)
READINESS_PERIOD_S = 2
#: terminationGracePeriodSeconds beyond the runtime's shutdown delay and drain timeout.
GRACE_MARGIN_S = 15


def selector_labels(name: str) -> dict[str, str]:
    return {NAME_LABEL: APP_NAME, INSTANCE_LABEL: name}


def router_selector_labels(name: str) -> dict[str, str]:
    """The router pods' selector: the model's instance, the router's app name (never the
    runtime's, so neither Deployment's selector matches the other's pods)."""
    return {NAME_LABEL: ROUTER_APP_NAME, INSTANCE_LABEL: name}


def selector_string(name: str) -> str:
    """The pods' selector as `kubectl get -l` and the scale subresource write it."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def router_selector_string(name: str) -> str:
    """The router pods' selector, as `selector_string` writes the runtime pods'."""
    return ",".join(f"{k}={v}" for k, v in sorted(router_selector_labels(name).items()))


def labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        "app.kubernetes.io/component": "inference-server",
        "app.kubernetes.io/part-of": "kubeinfer",
        MANAGED_BY_LABEL: MANAGED_BY,
    }


def endpoint(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc:{PORT}/v1"


def served_name(model: Mapping[str, Any], spec: InferenceModelSpec) -> str:
    return spec.model.served_name or model["metadata"]["name"]


def owner_reference(model: Mapping[str, Any]) -> dict[str, Any]:
    meta = model["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def wants_pdb(spec: InferenceModelSpec) -> bool:
    return spec.replicas > 1


#: Every child the operator may render, by id: id -> (kind, suffix of the model's name). The
#: ids key the reconciler's snapshot and plan (a kind alone no longer names one child: the
#: router has a Deployment of its own).
CHILDREN: dict[str, tuple[str, str]] = {
    "Deployment": ("Deployment", ""),
    "Service": ("Service", ""),
    "PodDisruptionBudget": ("PodDisruptionBudget", ""),
    "RouterServiceAccount": ("ServiceAccount", "-router"),
    "RouterRole": ("Role", "-router"),
    "RouterRoleBinding": ("RoleBinding", "-router"),
    "RouterDeployment": ("Deployment", "-router"),
    "InferencePool": ("InferencePool", ""),
}
CHILD_IDS = tuple(CHILDREN)


def child_ref(child: str, model_name: str) -> tuple[str, str]:
    """(kind, object name) of the child `child` of the model `model_name`."""
    kind, suffix = CHILDREN[child]
    return kind, model_name + suffix


def child_id(manifest: Mapping[str, Any], model_name: str) -> str:
    """The id of a rendered child of the model `model_name`."""
    kind, name = manifest["kind"], manifest["metadata"]["name"]
    for child, (child_kind, suffix) in CHILDREN.items():
        if child_kind == kind and name == model_name + suffix:
            return child
    raise KeyError(f"{kind} {name} is not a child of {model_name}")


def render(model: Mapping[str, Any], config: OperatorSettings) -> list[Manifest]:
    """The children of `model` (an InferenceModel as the API returns it); InvalidSpecError
    when its spec cannot be served."""
    # router_manifests builds on this module's helpers: imported here, not at the top
    from kubeinfer.operator.router_manifests import render_router

    spec = parse_spec(model.get("spec") or {})
    check_managed(spec)
    manifests = [render_deployment(model, spec, config), render_service(model, spec)]
    if wants_pdb(spec):
        manifests.append(render_pdb(model))
    if spec.routing.mode == "router":
        manifests.extend(render_router(model, spec, config))
    elif spec.routing.mode == "inferencePool":
        manifests.append(render_inference_pool(model, spec))
    return manifests


def check_managed(spec: InferenceModelSpec) -> None:
    """InvalidSpecError when extraArgs or env set what the operator manages (the CRD refuses
    it too; this covers objects stored under an older CRD)."""
    for arg in spec.runtime.extra_args:
        if arg.split("=", 1)[0] in MANAGED_FLAGS:
            raise InvalidSpecError(
                f"spec.runtime.extraArgs: {arg.split('=', 1)[0]} is set by the operator"
            )
    for var in spec.runtime.env:
        if var.name in MANAGED_ENV:
            raise InvalidSpecError(f"spec.runtime.env: {var.name} is set by the operator")


def _metadata(model: Mapping[str, Any]) -> dict[str, Any]:
    meta = model["metadata"]
    return {
        "name": meta["name"],
        "namespace": meta["namespace"],
        "labels": labels(meta["name"]),
        "ownerReferences": [owner_reference(model)],
    }


def render_deployment(
    model: Mapping[str, Any], spec: InferenceModelSpec, config: OperatorSettings
) -> Manifest:
    name = model["metadata"]["name"]
    source = parse_model_uri(spec.model.uri)
    check_hostpath(source, is_allowed=config.allow_hostpath, prefixes=config.hostpath_prefixes)
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the runtime never calls the API server
        "enableServiceLinks": False,  # a Service named `kubeinfer` would set KUBEINFER_PORT
        "terminationGracePeriodSeconds": termination_grace_s(config),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_runtime_container(model, spec, source, config)],
        "volumes": _volumes(source, config),
        **_scheduling(spec),
    }
    if source.scheme == "hf":
        pod_spec["initContainers"] = [_downloader(source, config)]
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(name)},
        # Default: a new pod is Ready before an old one goes (zero downtime; it needs room for
        # one more pod); spec.rollout trades that for clusters with no spare accelerator.
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {
                "maxSurge": spec.rollout.max_surge,
                "maxUnavailable": spec.rollout.max_unavailable,
            },
        },
        "revisionHistoryLimit": 3,
        "progressDeadlineSeconds": config.startup_budget_s + 600,
        "template": {"metadata": {"labels": labels(name)}, "spec": pod_spec},
    }
    if not spec.autoscaling.enabled:
        deployment_spec = {"replicas": spec.replicas, **deployment_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(model),
        "spec": deployment_spec,
    }


def termination_grace_s(config: OperatorSettings) -> int:
    """Covers the runtime's whole SIGTERM sequence: the shutdown delay, the drain, and its
    exit (closing connections, joining the engine: at most 7 s, see runtime/server/serve.py)."""
    return config.shutdown_delay_s + config.drain_timeout_s + GRACE_MARGIN_S


def readiness_failure_threshold(config: OperatorSettings) -> int:
    """Failed /ready reads before a pod counts as unready, so that it does within the
    runtime's shutdown delay (less a second for the status to travel): on SIGTERM the pod
    keeps serving that long with /ready failing, and clients that pick ready pods (routers,
    the dev cluster's clients; Services drop terminating pods at once) must have left it
    before it refuses work. With no delay there is nothing to fit: one failure."""
    return max(1, (config.shutdown_delay_s - 1) // READINESS_PERIOD_S)


def model_path(source: ModelSource) -> str:
    """The folder `--model` names inside the container."""
    if source.scheme == "pvc":
        return f"{MODELS_ROOT}/{source.path}" if source.path else MODELS_ROOT
    return f"{MODELS_ROOT}/model"


def runtime_args(
    model: Mapping[str, Any],
    spec: InferenceModelSpec,
    source: ModelSource,
    config: OperatorSettings,
) -> list[str]:
    rt = spec.runtime
    return [
        "--model", model_path(source),
        "--served-model-name", served_name(model, spec),
        "--host", "$(POD_IP)",
        "--port", str(PORT),
        "--probe-port", str(PROBE_PORT),
        "--device", "cuda" if spec.resources.gpus > 0 else "cpu",
        "--dtype", rt.dtype,
        "--max-model-len", str(rt.max_model_len),
        "--max-num-seqs", str(rt.max_num_seqs),
        "--max-num-batched-tokens", str(rt.max_num_batched_tokens),
        "--kv-cache-memory-fraction", f"{rt.kv_cache_memory_fraction:g}",
        "--enable-prefix-caching" if rt.enable_prefix_caching else "--no-enable-prefix-caching",
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--shutdown-delay", str(config.shutdown_delay_s),
        "--drain-timeout", str(config.drain_timeout_s),
        *rt.extra_args,
    ]  # fmt: skip


def restricted_container_security() -> dict[str, Any]:
    """A container's securityContext as the restricted Pod Security Standard asks (a fresh dict:
    the runtime's and the router's containers)."""
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _probe(path: str, period_s: int, failure_threshold: int, timeout_s: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "probes"},
        "periodSeconds": period_s,
        "timeoutSeconds": timeout_s,
        "failureThreshold": failure_threshold,
        "successThreshold": 1,
    }


def _runtime_container(
    model: Mapping[str, Any],
    spec: InferenceModelSpec,
    source: ModelSource,
    config: OperatorSettings,
) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        # The root filesystem is read-only: caches (torch, triton) and HOME live in /tmp.
        {"name": "HOME", "value": "/tmp"},
    ]
    if spec.api_key_secret_ref.is_set:
        ref = spec.api_key_secret_ref
        env.append(
            {
                "name": "KUBEINFER_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
            }
        )
    if not any(var.name == "OMP_NUM_THREADS" for var in spec.runtime.env):
        # torch's CPU thread pool sized to the CPU request, not to the node's cores: pods
        # sharing a node would otherwise each spin as many threads as it has cores
        env.append(
            {
                "name": "OMP_NUM_THREADS",
                "valueFrom": {
                    "resourceFieldRef": {
                        "containerName": RUNTIME_CONTAINER,
                        "resource": "requests.cpu",
                        "divisor": "1",
                    }
                },
            }
        )
    env.extend(var.to_api() for var in spec.runtime.env)
    res = spec.resources
    requests: dict[str, Any] = {"cpu": str(res.cpu), "memory": str(res.memory)}
    limits: dict[str, Any] = {"memory": str(res.memory)}
    if res.gpus > 0:
        requests[res.gpu_resource_name] = str(res.gpus)
        limits[res.gpu_resource_name] = str(res.gpus)
    startup_period_s = 2
    return {
        "name": RUNTIME_CONTAINER,
        "image": spec.runtime.image or config.runtime_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["kubeinfer", "serve"],
        "args": runtime_args(model, spec, source, config),
        "env": env,
        "ports": [
            {"name": "http", "containerPort": PORT, "protocol": "TCP"},
            {"name": "probes", "containerPort": PROBE_PORT, "protocol": "TCP"},
        ],
        # The startup probe asks /ready, so a load that hangs (never ready) is restarted once
        # the startup budget is spent; liveness (/health) takes over once the model serves.
        "startupProbe": _probe(
            "/ready", startup_period_s, max(1, config.startup_budget_s // startup_period_s), 2
        ),
        "readinessProbe": _probe(
            "/ready", READINESS_PERIOD_S, readiness_failure_threshold(config), 2
        ),
        "livenessProbe": _probe("/health", 10, 3, 5),
        "resources": {"requests": requests, "limits": limits},
        "securityContext": restricted_container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": _mounts(source),
    }


def _mounts(source: ModelSource) -> list[dict[str, Any]]:
    model_mount = MODELS_ROOT if source.scheme == "pvc" else f"{MODELS_ROOT}/model"
    return [
        {"name": "model", "mountPath": model_mount, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]


def _volumes(source: ModelSource, config: OperatorSettings) -> list[dict[str, Any]]:
    if source.scheme == "pvc":
        model: dict[str, Any] = {
            "name": "model",
            "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True},
        }
    elif source.scheme == "hostpath":
        model = {"name": "model", "hostPath": {"path": source.path, "type": "Directory"}}
    else:  # hf: the init container downloads into it
        model = {"name": "model", "emptyDir": {}}
    return [
        model,
        # A container runtime's own /dev/shm is 64 MiB: too small for NCCL's shared-memory
        # transport and torch's inter-process tensors between tensor-parallel ranks. A tmpfs
        # sizeLimit is a cap, not a reservation (pages count against the memory limit as they
        # are used), so one size for every tensorParallelSize; KUBEINFER_OPERATOR_SHM_SIZE
        # raises it.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": config.shm_size}},
        {"name": "tmp", "emptyDir": {}},
    ]


def _downloader(source: ModelSource, config: OperatorSettings) -> dict[str, Any]:
    """An init container that fetches an hf:// model into the `model` emptyDir."""
    revision = f", revision={source.revision!r}" if source.revision else ""
    script = (
        "pip install --quiet --no-cache-dir --target /tmp/hf 'huggingface_hub>=0.24' && "
        "PYTHONPATH=/tmp/hf python -c "
        + shlex.quote(
            "from huggingface_hub import snapshot_download; "
            f"snapshot_download({source.repo!r}{revision}, local_dir='/models/model', "
            "allow_patterns=['*.json', '*.safetensors', '*.txt', '*.model'])"
        )
    )
    return {
        "name": "download",
        "image": config.downloader_image,
        "command": ["sh", "-c", script],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "volumeMounts": [
            {"name": "model", "mountPath": f"{MODELS_ROOT}/model"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def _scheduling(spec: InferenceModelSpec) -> dict[str, Any]:
    sched = spec.scheduling
    tolerations = list(sched.tolerations)
    if spec.resources.gpus > 0:
        # GPU node pools are commonly tainted with the resource name.
        gpu = {
            "key": spec.resources.gpu_resource_name,
            "operator": "Exists",
            "effect": "NoSchedule",
        }
        if gpu not in tolerations:
            tolerations.append(gpu)
    out: dict[str, Any] = {}
    if sched.node_selector:
        out["nodeSelector"] = dict(sched.node_selector)
    if tolerations:
        out["tolerations"] = tolerations
    if sched.affinity:
        out["affinity"] = dict(sched.affinity)
    if sched.priority_class_name:
        out["priorityClassName"] = sched.priority_class_name
    if sched.runtime_class_name:
        out["runtimeClassName"] = sched.runtime_class_name
    return out


def render_service(model: Mapping[str, Any], spec: InferenceModelSpec) -> Manifest:
    """The model's endpoint: its router pods in routing mode `router`, else its runtime pods."""
    name = model["metadata"]["name"]
    is_routed = spec.routing.mode == "router"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(model),
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector_labels(name) if is_routed else selector_labels(name),
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_pdb(model: Mapping[str, Any]) -> Manifest:
    name = model["metadata"]["name"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(model),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
    }


INFERENCE_POOL_API = "inference.networking.k8s.io/v1"


def render_inference_pool(model: Mapping[str, Any], spec: InferenceModelSpec) -> Manifest:
    """Routing mode inferencePool: a Gateway API Inference Extension InferencePool of the
    model's runtime pods (their API port), for a gateway and its endpoint picker, which reads
    the runtime's vllm:* metrics (`vllm:cache_config_info` included)."""
    name = model["metadata"]["name"]
    pool: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(name)},
        "targetPorts": [{"number": PORT}],
    }
    picker = spec.routing.endpoint_picker
    if picker is not None:
        pool["endpointPickerRef"] = {"name": picker.name, "port": {"number": picker.port}}
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": _metadata(model),
        "spec": pool,
    }
