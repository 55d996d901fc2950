"""The node agent: registers the dev nodes, keeps them alive, and runs one `PodWorker` per pod
the scheduler binds to them (list, then watch, relisting when the watch expires).

It acts with the admin credentials: a stand-in for the kubelet, not a model of its node
authorization. On SIGTERM it stops every pod's processes and exits; the pod objects stay, and
the next agent starts them again (as after a node reboot).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3Error

from kubeinfer.devcluster import processes
from kubeinfer.devcluster.config import AgentConfig
from kubeinfer.devcluster.nodeagent import nodes
from kubeinfer.devcluster.nodeagent.container import now_iso
from kubeinfer.devcluster.nodeagent.ipam import Ipam
from kubeinfer.devcluster.nodeagent.kube import Kube
from kubeinfer.devcluster.nodeagent.worker import AgentContext, PodWorker

logger = logging.getLogger(__name__)

TERMINAL_PHASES = ("Succeeded", "Failed")


class NodeAgent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.kube = Kube(config.kubeconfig)
        self.ctx = AgentContext(
            config=config,
            kube=self.kube,
            ipam=Ipam(config.pod_cidr, str(config.state_dir.resolve())),
        )
        self.node_names = set(config.nodes.node_names())
        self.workers: dict[str, PodWorker] = {}
        self.stopping = threading.Event()
        self.started_at = now_iso()

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT, then stop every pod's processes."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self.config.container_pids_dir.mkdir(parents=True, exist_ok=True)
        self._stop_orphans()
        nodes.register(self.kube, self.config, self.started_at)
        threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True).start()
        watcher = threading.Thread(target=self._watch_pods, name="watch", daemon=True)
        watcher.start()
        self.stopping.wait()
        self._shutdown()

    def _stop_orphans(self) -> None:
        """Containers an earlier agent left running (it was killed): stop them, since this
        agent starts every pod afresh and they would hold the pods' addresses and ports."""
        for path in self.config.container_pids_dir.glob("*.json"):
            record = processes.read_record(path)
            if record is not None and record.is_alive():
                logger.warning(
                    "stopping %s (pid %d), left by an earlier agent", record.name, record.pid
                )
                processes.stop(record, grace_s=5)
            path.unlink(missing_ok=True)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        logger.info("signal %d: stopping", signum)
        self.stopping.set()

    def _heartbeats(self) -> None:
        while not self.stopping.wait(self.config.heartbeat_s):
            nodes.heartbeat(self.kube, self.config, self.started_at)

    def _watch_pods(self) -> None:
        while not self.stopping.is_set():
            try:
                pods, version = self.kube.list_pods()
                seen = set()
                for pod in pods:
                    seen.add(pod["metadata"]["uid"])
                    self._on_pod("ADDED", pod)
                for uid in set(self.workers) - seen:  # gone while we were not watching
                    self._on_pod("DELETED", self.workers[uid].pod)
                while not self.stopping.is_set():
                    for event_type, pod in self.kube.watch_pods(version):
                        if event_type == "ERROR":
                            raise _WatchExpiredError(str(pod))
                        version = pod["metadata"].get("resourceVersion", version)
                        self._on_pod(event_type, pod)
                        if self.stopping.is_set():
                            return
            except _WatchExpiredError as exc:
                logger.info("pod watch expired (%s): relisting", exc)
            except (ApiException, Urllib3Error, OSError) as exc:
                if self.stopping.is_set():
                    return
                logger.warning("pod watch failed (%s): relisting in 2s", exc)
                time.sleep(2)
            except Exception:
                logger.exception("pod watch crashed: relisting in 2s")
                time.sleep(2)

    def _on_pod(self, event_type: str, pod: dict[str, Any]) -> None:
        if pod.get("spec", {}).get("nodeName") not in self.node_names:
            return
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if event_type == "DELETED":
            if worker is not None:
                worker.vanish()
                del self.workers[uid]
            return
        if worker is not None:
            if worker.is_alive():
                worker.update(pod)
            else:
                del self.workers[uid]
            return
        phase = (pod.get("status") or {}).get("phase")
        if phase in TERMINAL_PHASES and not pod["metadata"].get("deletionTimestamp"):
            return  # finished before this agent started: nothing to run
        worker = PodWorker(pod, self.ctx)
        self.workers[uid] = worker
        worker.start()

    def _shutdown(self) -> None:
        workers = list(self.workers.values())
        for worker in workers:
            worker.shutdown()
        for worker in workers:
            worker.join(timeout=15)
        logger.info("stopped %d pod workers", len(workers))


class _WatchExpiredError(Exception):
    """The API server ended the watch with an error (typically 410 Gone)."""
