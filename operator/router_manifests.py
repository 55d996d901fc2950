"""The model's router (`spec.routing.mode: router`), rendered (pure): `render_router(...)`.

Four objects named `NAME-router`, owned by the model like its other children:

- a ServiceAccount, a Role that may read pods in the model's namespace (the router lists the
  model's ready pods by label selector: dev-cluster pods have loopback IPs that EndpointSlices
  reject, and pods carry readiness as the kubelet last reported it) and the RoleBinding
  between them: the only API access the router has;
- a Deployment of `kubeinfer router --selector <the model's pod labels>`: 1+ replicas, no
  accelerator, probes on its /health and /ready, bound to its pod IP like the runtime.

The model's Service (named like the model: `status.endpoint` does not change with the mode)
then selects the router pods instead of the runtime pods (`manifests.render_service`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubeinfer.operator.manifests import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    PORT,
    Manifest,
    owner_reference,
    restricted_container_security,
    router_selector_labels,
    selector_string,
    served_name,
)
from kubeinfer.operator.settings import OperatorSettings
from kubeinfer.operator.spec import InferenceModelSpec

ROUTER_SUFFIX = "-router"  # manifests.CHILDREN names the same
ROUTER_CONTAINER = "router"
#: The router's own SIGTERM drain (`--drain-timeout-s`) and what its pods get beyond it.
ROUTER_DRAIN_S = 30
ROUTER_GRACE_MARGIN_S = 5
#: What one router container asks for: an asyncio proxy, no accelerator.
ROUTER_CPU = "250m"
ROUTER_MEMORY = "512Mi"


def router_name(name: str) -> str:
    return name + ROUTER_SUFFIX


def router_labels(name: str) -> dict[str, str]:
    return {
        **router_selector_labels(name),
        "app.kubernetes.io/component": "router",
        "app.kubernetes.io/part-of": "kubeinfer",
        MANAGED_BY_LABEL: MANAGED_BY,
    }


def _metadata(model: Mapping[str, Any]) -> dict[str, Any]:
    meta = model["metadata"]
    return {
        "name": router_name(meta["name"]),
        "namespace": meta["namespace"],
        "labels": router_labels(meta["name"]),
        "ownerReferences": [owner_reference(model)],
    }


def render_router(
    model: Mapping[str, Any], spec: InferenceModelSpec, config: OperatorSettings
) -> list[Manifest]:
    """The router's ServiceAccount, Role, RoleBinding and Deployment, in that order."""
    name = router_name(model["metadata"]["name"])
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(model)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(model),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(model),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": name,
                    "namespace": model["metadata"]["namespace"],
                }
            ],
        },
        render_router_deployment(model, spec, config),
    ]


def router_args(model: Mapping[str, Any], spec: InferenceModelSpec) -> list[str]:
    meta, routing = model["metadata"], spec.routing
    return [
        "--selector", selector_string(meta["name"]),
        "--namespace", meta["namespace"],
        "--pod-port", str(PORT),
        "--model-name", served_name(model, spec),
        "--host", "$(POD_IP)",
        "--port", str(PORT),
        "--max-held-requests", str(routing.max_held_requests),
        "--max-hold-s", str(routing.max_hold_seconds),
        "--drain-timeout-s", str(ROUTER_DRAIN_S),
    ]  # fmt: skip


def _probe(path: str, period_s: int, failure_threshold: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period_s,
        "timeoutSeconds": 2,
        "failureThreshold": failure_threshold,
        "successThreshold": 1,
    }


def router_replicas(spec: InferenceModelSpec) -> int:
    """The router's pods: none while the model is paused (`replicas: 0` without autoscaling:
    nothing to route to and nothing to scale from zero, so a paused model costs no pod at
    all), else `routing.replicas`. With autoscaling the router always runs: at zero replicas
    it holds the requests that bring the model back."""
    if spec.replicas == 0 and not spec.autoscaling.enabled:
        return 0
    return spec.routing.replicas


def render_router_deployment(
    model: Mapping[str, Any], spec: InferenceModelSpec, config: OperatorSettings
) -> Manifest:
    model_name = model["metadata"]["name"]
    container = {
        "name": ROUTER_CONTAINER,
        "image": config.router_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["kubeinfer", "router"],
        "args": router_args(model, spec),
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "HOME", "value": "/tmp"},
        ],
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "startupProbe": _probe("/health", 1, 60),
        "readinessProbe": _probe("/ready", 2, 2),
        "livenessProbe": _probe("/health", 10, 3),
        "resources": {
            "requests": {"cpu": ROUTER_CPU, "memory": ROUTER_MEMORY},
            "limits": {"memory": ROUTER_MEMORY},
        },
        "securityContext": restricted_container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": router_name(model_name),
        "automountServiceAccountToken": True,  # it lists the model's pods
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": ROUTER_DRAIN_S + ROUTER_GRACE_MARGIN_S,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(model),
        "spec": {
            "replicas": router_replicas(spec),
            "selector": {"matchLabels": router_selector_labels(model_name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": 3,
            "template": {"metadata": {"labels": router_labels(model_name)}, "spec": pod_spec},
        },
    }
