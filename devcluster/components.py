"""The dev cluster's components and their command lines (pure: no process is started here).

Everything listens on 127.0.0.1 only. The service range is bookkeeping: nothing connects to a
ClusterIP (there is no kube-proxy). `--endpoint-reconciler-type=none` because endpoint
validation rejects loopback addresses.
"""

from __future__ import annotations

import json
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

ComponentName = Literal[
    "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "node-agent"
]
#: Start order; `down` stops them in reverse.
COMPONENTS: tuple[ComponentName, ...] = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "node-agent",
)
# The API server allocates ClusterIPs from this range; nothing here ever connects to one (no
# kube-proxy; clients use pod IPs from 127.1.0.0/16). A /16: bench/operator_scale.py makes 500
# Services, and a /24 (254 addresses) failed the 255th with "range is full" (HTTP 500). The
# default ServiceCIDR object keeps the range of a cluster's first `up`: `down --purge` renews it.
SERVICE_CIDR = "10.0.0.0/16"
HOST = "127.0.0.1"


@dataclass(slots=True, frozen=True)
class Ports:
    """Loopback ports of one dev cluster, chosen free at the first `up` and kept after."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int

    @classmethod
    def allocate(cls) -> Ports:
        socks = []
        try:
            for _ in range(5):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind((HOST, 0))
                socks.append(s)
            return cls(*(s.getsockname()[1] for s in socks))
        finally:
            for s in socks:
                s.close()


@dataclass(slots=True, frozen=True)
class Layout:
    """Where one dev cluster keeps its state, all under `root` (`.cache/dev/`)."""

    root: Path

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def ca_file(self) -> Path:
        """The API server's self-signed serving certificate (written by the API server)."""
        return self.pki / "apiserver.crt"

    @property
    def token_file(self) -> Path:
        return self.pki / "tokens.csv"

    @property
    def sa_key(self) -> Path:
        return self.pki / "sa.key"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def agent_config(self) -> Path:
        return self.root / "agent.json"

    def pid_file(self, name: ComponentName) -> Path:
        return self.pids / f"{name}.json"

    def log_file(self, name: ComponentName) -> Path:
        return self.logs / f"{name}.log"


@dataclass(slots=True, frozen=True)
class ClusterState:
    """What `up` decided once and later commands read back: ports and binaries."""

    ports: Ports
    bin_dir: str
    kubernetes_version: str

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> ClusterState | None:
        try:
            data = json.loads(path.read_text())
            return cls(Ports(**data["ports"]), data["bin_dir"], data["kubernetes_version"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


def api_server_url(ports: Ports) -> str:
    return f"https://{HOST}:{ports.apiserver}"


def command_line(name: ComponentName, bin_dir: Path, layout: Layout, ports: Ports) -> list[str]:
    """The argv that starts component `name`."""
    d, p = layout, ports
    if name == "etcd":
        return [
            str(bin_dir / "etcd"),
            "--name=default",
            f"--data-dir={d.etcd_data}",
            f"--listen-client-urls=http://{HOST}:{p.etcd_client}",
            f"--advertise-client-urls=http://{HOST}:{p.etcd_client}",
            f"--listen-peer-urls=http://{HOST}:{p.etcd_peer}",
            f"--initial-advertise-peer-urls=http://{HOST}:{p.etcd_peer}",
            f"--initial-cluster=default=http://{HOST}:{p.etcd_peer}",
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        ]
    if name == "kube-apiserver":
        return [
            str(bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://{HOST}:{p.etcd_client}",
            f"--bind-address={HOST}",
            f"--advertise-address={HOST}",
            f"--secure-port={p.apiserver}",
            f"--cert-dir={d.pki}",
            f"--token-auth-file={d.token_file}",
            "--authorization-mode=RBAC",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--service-account-issuer={api_server_url(p)}",
            f"--service-account-key-file={d.sa_key}",
            f"--service-account-signing-key-file={d.sa_key}",
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
        ]
    if name == "kube-controller-manager":
        return [
            str(bin_dir / "kube-controller-manager"),
            *_component_auth(d),
            f"--bind-address={HOST}",
            f"--secure-port={p.controller_manager}",
            f"--cert-dir={d.pki / 'kube-controller-manager'}",
            "--leader-elect=false",
            f"--service-account-private-key-file={d.sa_key}",
            f"--root-ca-file={d.ca_file}",
            "--use-service-account-credentials=true",
            "--kube-api-qps=100",
            "--kube-api-burst=200",
            "--profiling=false",
            "--v=1",
        ]
    if name == "kube-scheduler":
        return [
            str(bin_dir / "kube-scheduler"),
            *_component_auth(d),
            f"--bind-address={HOST}",
            f"--secure-port={p.scheduler}",
            f"--cert-dir={d.pki / 'kube-scheduler'}",
            "--leader-elect=false",
            "--kube-api-qps=100",
            "--kube-api-burst=200",
            "--profiling=false",
            "--v=1",
        ]
    if name == "node-agent":
        return [
            sys.executable,
            "-m",
            "kubeinfer.devcluster.nodeagent",
            "--config",
            str(d.agent_config),
        ]
    raise ValueError(f"unknown component {name!r}")


def _component_auth(d: Layout) -> list[str]:
    return [
        f"--kubeconfig={d.kubeconfig}",
        f"--authentication-kubeconfig={d.kubeconfig}",
        f"--authorization-kubeconfig={d.kubeconfig}",
    ]


def health_url(name: ComponentName, ports: Ports) -> str | None:
    """Where the component says it is healthy (None: the node agent, judged by its nodes)."""
    return {
        "etcd": f"http://{HOST}:{ports.etcd_client}/health",
        "kube-apiserver": f"https://{HOST}:{ports.apiserver}/readyz",
        "kube-controller-manager": f"https://{HOST}:{ports.controller_manager}/healthz",
        "kube-scheduler": f"https://{HOST}:{ports.scheduler}/healthz",
    }.get(name)
