"""`dev up`, `dev down`, `dev status`: bring the dev cluster's processes up in order, wait for
each to be healthy, and stop every one of them (and every container the node agent started)
by pid.

`up` is idempotent: a component whose recorded process still runs is kept, a missing one is
started again on the ports chosen the first time.
"""

from __future__ import annotations

import logging
import os
import shutil
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from kubeinfer.devcluster import processes
from kubeinfer.devcluster.components import (
    COMPONENTS,
    ClusterState,
    ComponentName,
    Layout,
    Ports,
    api_server_url,
    command_line,
    health_url,
)
from kubeinfer.devcluster.config import (
    AgentConfig,
    DevClusterError,
    NodeConfig,
    default_bin_dir,
    default_state_dir,
    pinned_kubernetes_version,
)
from kubeinfer.devcluster.credentials import (
    ensure_signing_key,
    ensure_token_file,
    render_kubeconfig,
    write_kubeconfig,
)

logger = logging.getLogger(__name__)

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
#: How long each component may take to become healthy (2 slow cores, tests running beside).
STARTUP_TIMEOUT_S: dict[ComponentName, float] = {
    "etcd": 60,
    "kube-apiserver": 180,
    "kube-controller-manager": 120,
    "kube-scheduler": 120,
    "node-agent": 120,
}


@dataclass(slots=True)
class ComponentStatus:
    name: ComponentName
    pid: int | None
    is_running: bool
    is_healthy: bool
    detail: str = ""


@dataclass(slots=True)
class DevCluster:
    """One dev cluster, identified by its state folder."""

    layout: Layout
    bin_dir: Path
    nodes: NodeConfig

    @classmethod
    def from_env(cls, state_dir: Path | None = None, num_nodes: int | None = None) -> DevCluster:
        layout = Layout(state_dir or default_state_dir())
        nodes = NodeConfig() if num_nodes is None else NodeConfig(num_nodes=num_nodes)
        state = ClusterState.load(layout.state_file)
        bin_dir = Path(state.bin_dir) if state else default_bin_dir()
        return cls(layout=layout, bin_dir=bin_dir, nodes=nodes)

    @property
    def kubeconfig(self) -> Path:
        return self.layout.kubeconfig

    # --- up ---------------------------------------------------------------------------------

    def up(self, progress: Callable[[str], None] = logger.info) -> ClusterState:
        """Start whatever is not running, wait until the cluster serves, return its state."""
        self._check_binaries()
        d = self.layout
        for folder in (d.root, d.pki, d.logs, d.pids, d.etcd_data.parent):
            folder.mkdir(parents=True, exist_ok=True)
        token = ensure_token_file(d.token_file)
        ensure_signing_key(d.sa_key)
        state = ClusterState.load(d.state_file)
        if state is None:
            state = ClusterState(Ports.allocate(), str(self.bin_dir), pinned_kubernetes_version())
            state.save(d.state_file)
        ports = state.ports
        write_kubeconfig(
            d.kubeconfig,
            render_kubeconfig(server=api_server_url(ports), ca_file=d.ca_file, token=token),
        )
        self._write_agent_config(ports)
        for name in COMPONENTS:
            record = processes.read_record(d.pid_file(name))
            if record and record.is_alive():
                progress(f"{name}: running (pid {record.pid})")
                continue
            start = time.monotonic()
            progress(f"{name}: starting")
            _, record = processes.spawn(
                name,
                command_line(name, self.bin_dir, d, ports),
                log_path=d.log_file(name),
                env=_component_env(),
            )
            processes.write_record(d.pid_file(name), record)
            self._wait_healthy(name, ports, token, record)
            if name == "kube-controller-manager":
                self._wait_default_service_account()
            progress(f"{name}: ready in {time.monotonic() - start:.1f}s (pid {record.pid})")
        return state

    def _check_binaries(self) -> None:
        missing = [b for b in BINARIES if not os.access(self.bin_dir / b, os.X_OK)]
        if missing:
            raise DevClusterError(
                f"control-plane binaries missing in {self.bin_dir}: {', '.join(missing)}; "
                "build them with `make controlplane`"
            )

    def _write_agent_config(self, ports: Ports) -> None:
        config = AgentConfig(
            kubeconfig=self.layout.kubeconfig,
            kubernetes_version=pinned_kubernetes_version(),
            api_port=ports.apiserver,
            ca_file=self.layout.ca_file,
            state_dir=self.layout.root,
            nodes=self.nodes,
        )
        self.layout.agent_config.write_text(config.model_dump_json(indent=2))

    def _wait_healthy(
        self, name: ComponentName, ports: Ports, token: str, record: processes.PidRecord
    ) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S[name]
        while True:
            if not record.is_alive():
                raise DevClusterError(
                    f"{name} exited during startup; last lines of {self.layout.log_file(name)}:\n"
                    + _tail(self.layout.log_file(name))
                )
            ok, detail = self._probe(name, ports, token)
            if ok:
                return
            if time.monotonic() > deadline:
                raise DevClusterError(
                    f"{name} not healthy after {STARTUP_TIMEOUT_S[name]:.0f}s ({detail}); "
                    f"see {self.layout.log_file(name)}:\n" + _tail(self.layout.log_file(name))
                )
            time.sleep(0.5)

    def _probe(self, name: ComponentName, ports: Ports, token: str) -> tuple[bool, str]:
        if name == "node-agent":
            return self._nodes_ready()
        url = health_url(name, ports)
        assert url is not None
        headers = {"Authorization": f"Bearer {token}"} if name == "kube-apiserver" else {}
        # The API server is checked against its own certificate. The controller-manager's and
        # scheduler's health ports self-sign in memory: a loopback health probe skips checking.
        verify: bool | ssl.SSLContext = (
            ssl.create_default_context(cafile=str(self.layout.ca_file))
            if name == "kube-apiserver" and self.layout.ca_file.exists()
            else False
        )
        if name == "kube-apiserver" and not self.layout.ca_file.exists():
            return False, "no serving certificate yet"
        try:
            resp = httpx.get(url, headers=headers, verify=verify, timeout=5)
        except httpx.HTTPError as exc:
            return False, f"{url}: {exc.__class__.__name__}"
        return resp.status_code == 200, f"HTTP {resp.status_code} on port {url.split(':')[2]}"

    def _wait_default_service_account(self, timeout_s: float = 120) -> None:
        """Pods cannot be created until the controller-manager made `default/default`."""
        core = self.core_api()
        deadline = time.monotonic() + timeout_s
        from kubernetes.client.exceptions import ApiException

        while True:
            try:
                core.read_namespaced_service_account("default", "default")
                core.read_namespaced_config_map("kube-root-ca.crt", "default")
                return
            except ApiException as exc:
                if exc.status != 404 or time.monotonic() > deadline:
                    raise DevClusterError(f"default service account never appeared: {exc}") from exc
            time.sleep(0.5)

    def _nodes_ready(self) -> tuple[bool, str]:
        from kubernetes.client.exceptions import ApiException

        try:
            nodes = self.core_api().list_node().items
        except (ApiException, OSError) as exc:
            return False, f"list nodes: {exc}"
        wanted = set(self.nodes.node_names())
        ready = {
            n.metadata.name
            for n in nodes
            if any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or []))
        }
        return wanted <= ready, f"{len(wanted & ready)}/{len(wanted)} nodes Ready"

    def core_api(self):  # type: ignore[no-untyped-def]
        """A kubernetes CoreV1Api on the admin kubeconfig."""
        from kubernetes import client, config

        return client.CoreV1Api(config.new_client_from_config(config_file=str(self.kubeconfig)))

    # --- down / status ----------------------------------------------------------------------

    def down(self, *, purge: bool = False, progress: Callable[[str], None] = logger.info) -> None:
        """Stop every process `up` started, the agent's containers included; `purge` also
        deletes the state folder (etcd data, certificates, logs)."""
        d = self.layout
        for name in reversed(COMPONENTS):
            record = processes.read_record(d.pid_file(name))
            if record is None:
                continue
            was_running = record.is_alive()
            # The agent stops its pods itself (SIGTERM, their grace, SIGKILL): give it time.
            processes.stop(record, grace_s=30 if name == "node-agent" else 15)
            d.pid_file(name).unlink(missing_ok=True)
            if was_running:
                progress(f"{name}: stopped (pid {record.pid})")
        for path in sorted(d.pids.glob("containers/*.json")):
            record = processes.read_record(path)
            if record and record.is_alive():
                processes.stop(record, grace_s=5)
                progress(f"container {record.name}: stopped (pid {record.pid}), left by the agent")
            path.unlink(missing_ok=True)
        if purge and d.root.exists():
            shutil.rmtree(d.root)
            progress(f"removed {d.root}")

    def status(self) -> list[ComponentStatus]:
        state = ClusterState.load(self.layout.state_file)
        token = ensure_token_file(self.layout.token_file) if self.layout.token_file.exists() else ""
        result = []
        for name in COMPONENTS:
            record = processes.read_record(self.layout.pid_file(name))
            running = bool(record and record.is_alive())
            healthy, detail = False, "not running"
            if running and state is not None:
                healthy, detail = self._probe(name, state.ports, token)
            result.append(
                ComponentStatus(name, record.pid if record else None, running, healthy, detail)
            )
        return result

    def recorded_pids(self) -> list[processes.PidRecord]:
        """Every process record `up` and the agent left (to check that `down` left none)."""
        paths = [*self.layout.pids.glob("*.json"), *self.layout.pids.glob("containers/*.json")]
        return [r for p in paths if (r := processes.read_record(p))]


def _component_env() -> dict[str, str]:
    """The components' environment: the caller's, without its own cluster settings."""
    env = dict(os.environ)
    for key in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        env.pop(key, None)
    return env


def _tail(path: Path, num_lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"
