"""The agent's Node objects: what they advertise (pure) and keeping them alive (status
heartbeat and a Lease in kube-node-lease, or the node lifecycle controller marks them
NotReady, taints them and evicts their pods)."""

from __future__ import annotations

import logging
import platform
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from kubeinfer.devcluster.config import AgentConfig
from kubeinfer.devcluster.nodeagent.kube import SMP, Kube

logger = logging.getLogger(__name__)

NODE_LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node_manifest(name: str, config: AgentConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": "kubeinfer-dev",
                "kubeinfer.dev/dev-node": "true",
                "nvidia.com/gpu.present": "true",
            },
        },
        "spec": {},
    }


def node_status(config: AgentConfig, *, started_at: str) -> dict[str, Any]:
    """Capacity (fake GPUs included), addresses on loopback, and healthy conditions."""
    n = config.nodes
    capacity = {
        "cpu": n.cpu,
        "memory": n.memory,
        "pods": str(n.max_pods),
        "ephemeral-storage": "100Gi",
        n.gpu_resource_name: str(n.num_gpus),
    }
    now = _now()

    def cond(ctype: str, status: str, reason: str, message: str) -> dict[str, Any]:
        return {
            "type": ctype,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": started_at,
        }

    return {
        "capacity": capacity,
        "allocatable": capacity,
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
        "conditions": [
            cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "dev node"),
            cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "dev node"),
            cond("PIDPressure", "False", "KubeletHasSufficientPID", "dev node"),
            cond("Ready", "True", "KubeletReady", "kubeinfer dev node agent is posting status"),
        ],
        "nodeInfo": {
            "machineID": "kubeinfer-dev",
            "systemUUID": "kubeinfer-dev",
            "bootID": started_at,
            "kernelVersion": platform.release(),
            "osImage": "kubeinfer dev node agent",
            "containerRuntimeVersion": "kubeinfer-dev://0.1.0",
            "kubeletVersion": config.kubernetes_version,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }


def register(kube: Kube, config: AgentConfig, started_at: str) -> None:
    """Create each node (kept when it exists) and post its status."""
    for name in config.nodes.node_names():
        try:
            kube.core.create_node(node_manifest(name, config))
            logger.info("registered node %s", name)
        except ApiException as exc:
            if exc.status != 409:
                raise
    heartbeat(kube, config, started_at)


def heartbeat(kube: Kube, config: AgentConfig, started_at: str) -> None:
    """Post node status and renew each node's Lease."""
    status = node_status(config, started_at=started_at)
    for name in config.nodes.node_names():
        try:
            kube.core.patch_node_status(name, {"status": status}, _content_type=SMP)
            _renew_lease(kube, name)
        except ApiException as exc:
            logger.warning("heartbeat for node %s failed: %s", name, exc.reason)


def _renew_lease(kube: Kube, name: str) -> None:
    now = datetime.now(UTC)
    body = {
        "metadata": {"name": name, "namespace": NODE_LEASE_NAMESPACE},
        "spec": {
            "holderIdentity": name,
            "leaseDurationSeconds": LEASE_DURATION_S,
            "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        },
    }
    try:
        kube.coordination.patch_namespaced_lease(
            name, NODE_LEASE_NAMESPACE, body, _content_type=SMP
        )
    except ApiException as exc:
        if exc.status != 404:
            raise
        kube.coordination.create_namespaced_lease(NODE_LEASE_NAMESPACE, body)
