"""Configuration of the dev cluster and its node agent: where things live, what nodes look like,
which images map to which local environment.

Everything has a default that works from a checkout; `KUBEINFER_DEV_DIR` moves the cluster's
state (tests use it to run a second, throw-away cluster) and `KUBEINFER_BIN_DIR` points at
prebuilt control-plane binaries.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

#: The checkout this package was installed from (editable install: the working tree).
REPO_ROOT = Path(__file__).resolve().parent.parent
#: The Go wrapper module whose go.mod pins the Kubernetes release.
KUBERNETES_GO_MOD = REPO_ROOT / "hack" / "controlplane" / "kubernetes" / "go.mod"


class DevClusterError(RuntimeError):
    """The dev cluster could not be brought up, queried or taken down."""


def pinned_kubernetes_version(go_mod: Path = KUBERNETES_GO_MOD) -> str:
    """The `k8s.io/kubernetes` release that `hack/controlplane/kubernetes/go.mod` requires."""
    try:
        text = go_mod.read_text()
    except OSError as exc:
        raise DevClusterError(f"cannot read {go_mod}: {exc}") from exc
    match = re.search(r"^require k8s\.io/kubernetes (v\S+)", text, re.MULTILINE) or re.search(
        r"^\s+k8s\.io/kubernetes (v\S+)", text, re.MULTILINE
    )
    if not match:
        raise DevClusterError(f"{go_mod} does not require k8s.io/kubernetes")
    return match.group(1)


def default_bin_dir() -> Path:
    """Where `make controlplane` builds: ~/.cache/kubeinfer/bin/<k8s-version>/ (or env override)."""
    if env := os.environ.get("KUBEINFER_BIN_DIR"):
        return Path(env)
    cache = Path(os.environ.get("KUBEINFER_CACHE", Path.home() / ".cache" / "kubeinfer"))
    return cache / "bin" / pinned_kubernetes_version()


def default_state_dir() -> Path:
    """`.cache/dev/` in the working tree (or $KUBEINFER_DEV_DIR)."""
    if env := os.environ.get("KUBEINFER_DEV_DIR"):
        return Path(env).resolve()
    return REPO_ROOT / ".cache" / "dev"


class NodeConfig(BaseModel):
    """What each fake node advertises. Capacity is bookkeeping: the scheduler uses it, nothing
    enforces it."""

    name_prefix: str = Field("dev-gpu-", description="nodes are named PREFIX0, PREFIX1, ...")
    num_nodes: int = Field(2, ge=1, le=16, description="number of Node objects")
    cpu: str = Field("32", description="capacity.cpu of each node")
    memory: str = Field("256Gi", description="capacity.memory of each node")
    gpu_resource_name: str = Field("nvidia.com/gpu", description="extended resource for GPUs")
    num_gpus: int = Field(8, ge=0, description="capacity of the GPU resource on each node")
    max_pods: int = Field(110, ge=1, description="capacity.pods of each node")

    def node_names(self) -> list[str]:
        return [f"{self.name_prefix}{i}" for i in range(self.num_nodes)]


class ImageMapping(BaseModel):
    """How the node agent runs containers of images whose reference starts with `prefix`."""

    prefix: str = Field(
        description="image reference prefix, e.g. 'python:' or 'kubeinfer/runtime:'"
    )
    environment: Literal["venv", "system"] = Field(
        description="venv: the working tree's .venv/bin first on PATH; system: machine's python3"
    )
    entrypoint: list[str] = Field(
        default_factory=list,
        description="the image's ENTRYPOINT, used when a container has no command",
    )


def default_image_mappings() -> list[ImageMapping]:
    return [
        ImageMapping(prefix="kubeinfer/runtime:", environment="venv", entrypoint=["kubeinfer"]),
        ImageMapping(prefix="kubeinfer/operator:", environment="venv", entrypoint=["kubeinfer"]),
        ImageMapping(prefix="python:", environment="system", entrypoint=["python3"]),
    ]


class AgentConfig(BaseModel):
    """The node agent's settings (written to `.cache/dev/agent.json` by `dev up`)."""

    kubeconfig: Path = Field(description="admin kubeconfig the agent talks to the API server with")
    kubernetes_version: str = Field("v0.0.0", description="reported as the nodes' kubeletVersion")
    api_host: str = Field("127.0.0.1", description="loopback address of the API server")
    api_port: int = Field(ge=1, le=65535, description="secure port of the API server")
    ca_file: Path = Field(description="the API server's serving certificate (clients trust it)")
    state_dir: Path = Field(description="the dev cluster's state folder (.cache/dev)")
    nodes: NodeConfig = Field(default_factory=NodeConfig)
    images: list[ImageMapping] = Field(default_factory=default_image_mappings)
    venv_bin: Path = Field(
        REPO_ROOT / ".venv" / "bin", description="bin folder of the project venv"
    )
    pod_cidr: str = Field("127.1.0.0/16", description="pod IPs (must be inside 127.0.0.0/8)")
    restart_backoff_base_s: float = Field(1.0, gt=0, description="first restart delay; doubles")
    restart_backoff_max_s: float = Field(30.0, gt=0, description="restart delay cap")
    restart_backoff_reset_s: float = Field(
        120.0, gt=0, description="a container running this long has its backoff reset"
    )
    heartbeat_s: float = Field(10.0, gt=0, description="node status / lease renewal period")
    token_ttl_s: int = Field(3600, ge=600, description="lifetime of pod service-account tokens")

    @property
    def pods_dir(self) -> Path:
        """Per-container logs and per-pod files (kubeconfig, emptyDirs)."""
        return self.state_dir / "pods"

    @property
    def container_pids_dir(self) -> Path:
        """One file per running container process, so `dev down` can stop any the agent left."""
        return self.state_dir / "pids" / "containers"
