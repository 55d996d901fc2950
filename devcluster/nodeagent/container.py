"""One container of a pod as a sequence of local processes: start, watch, probe, stop, and
restart with exponential backoff. The restart decision itself (`should_restart`,
`backoff_delay`) is pure.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from kubeinfer.devcluster import processes
from kubeinfer.devcluster.nodeagent.podspec import LaunchSpec
from kubeinfer.devcluster.nodeagent.probes import ProbeKind, ProbeTracker

logger = logging.getLogger(__name__)

RestartPolicy = Literal["Always", "OnFailure", "Never"]


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def should_restart(policy: RestartPolicy, exit_code: int) -> bool:
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


def backoff_delay(num_crashes: int, base_s: float, max_s: float) -> float:
    """The kubelet's crash-loop backoff: base, 2*base, 4*base, ... capped at max."""
    return min(max_s, base_s * 2 ** max(0, num_crashes - 1))


@dataclass(slots=True)
class Terminated:
    exit_code: int
    reason: str
    started_at: str
    finished_at: str
    message: str = ""

    def to_api(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "exitCode": self.exit_code,
            "reason": self.reason,
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
        }
        if self.message:
            out["message"] = self.message
        return out


@dataclass(slots=True)
class ContainerRun:
    """The state of one container across its restarts, as the pod status shows it."""

    name: str
    image: str
    log_path: Path
    pids_dir: Path
    pod_key: str  # namespace_pod, names the pid record
    restart_count: int = 0
    num_crashes: int = 0  # consecutive short runs: drives the backoff
    waiting: tuple[str, str] | None = ("ContainerCreating", "")
    started_at: str | None = None
    started_monotonic: float = 0.0
    terminated: Terminated | None = None
    last_terminated: Terminated | None = None
    next_start_at: float = 0.0
    probes: dict[ProbeKind, ProbeTracker] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    record: processes.PidRecord | None = None
    kill_reason: str | None = None  # set when we kill it (liveness, startup), for the status

    # --- process ----------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self.proc is not None

    def start(self, spec: LaunchSpec, container: dict[str, Any]) -> None:
        """Start a process for the container; a restart counts into restartCount."""
        if self.started_at is not None or self.terminated is not None:
            self.restart_count += 1
        if self.terminated is not None:
            self.last_terminated = self.terminated
        spec.cwd.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- {now_iso()} start #{self.restart_count}: {spec.argv!r}\n".encode())
        self.proc, self.record = processes.spawn(
            f"{self.pod_key}/{self.name}",
            spec.argv,
            log_path=self.log_path,
            env=spec.env,
            cwd=spec.cwd,
        )
        processes.write_record(self._record_path(), self.record)
        self.waiting, self.terminated, self.kill_reason = None, None, None
        self.started_at, self.started_monotonic = now_iso(), time.monotonic()
        self.probes = {
            kind: ProbeTracker(kind, container[key], self.started_monotonic)
            for kind, key in (
                ("startup", "startupProbe"),
                ("readiness", "readinessProbe"),
                ("liveness", "livenessProbe"),
            )
            if container.get(key)
        }
        logger.info("started %s/%s (pid %d)", self.pod_key, self.name, self.proc.pid)

    def poll(self) -> Terminated | None:
        """If the process has exited, record it as terminated and return that."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            return None
        self._reap_group()
        exit_code = code if code >= 0 else 128 - code  # killed by signal N: 128+N
        reason = self.kill_reason or ("Completed" if exit_code == 0 else "Error")
        self.terminated = Terminated(exit_code, reason, self.started_at or now_iso(), now_iso())
        self.proc = None
        self._record_path().unlink(missing_ok=True)
        logger.info("%s/%s exited with %d (%s)", self.pod_key, self.name, exit_code, reason)
        return self.terminated

    def kill(self, grace_s: float, reason: str | None = None) -> Terminated | None:
        """SIGTERM the process group, wait up to `grace_s`, SIGKILL; return how it ended."""
        if self.proc is None or self.record is None:
            return None
        self.kill_reason = reason
        processes.stop(self.record, grace_s=grace_s)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        return self.poll()

    def _reap_group(self) -> None:
        """Children the process left behind in its group go with it."""
        if self.record is not None and processes.group_members(self.record):
            processes.stop(self.record, grace_s=2)

    def _record_path(self) -> Path:
        return self.pids_dir / f"{self.pod_key}_{self.name}.json"

    # --- status -----------------------------------------------------------------------------

    @property
    def is_started(self) -> bool:
        """Running and past its startup probe (if any)."""
        startup = self.probes.get("startup")
        return self.is_running and (startup is None or (startup.has_result and startup.is_success))

    @property
    def is_ready(self) -> bool:
        readiness = self.probes.get("readiness")
        return self.is_started and (readiness is None or readiness.is_success)

    def to_api(self) -> dict[str, Any]:
        """This container's entry in `status.containerStatuses` (or initContainerStatuses).

        Every state key is present, the two unused ones as null, so a strategic merge patch
        replaces the state instead of merging two into one."""
        state: dict[str, Any] = {"waiting": None, "running": None, "terminated": None}
        if self.is_running:
            state["running"] = {"startedAt": self.started_at}
        elif self.waiting is not None:
            reason, message = self.waiting
            state["waiting"] = {"reason": reason, **({"message": message} if message else {})}
        elif self.terminated is not None:
            state["terminated"] = self.terminated.to_api()
        last: dict[str, Any] = {"waiting": None, "running": None, "terminated": None}
        if self.last_terminated is not None:
            last["terminated"] = self.last_terminated.to_api()
        return {
            "name": self.name,
            "image": self.image,
            "imageID": f"dev://{self.image}",
            "containerID": f"dev://{self.record.pid}" if self.record else None,
            "ready": self.is_ready,
            "started": self.is_started,
            "restartCount": self.restart_count,
            "state": state,
            "lastState": last,
        }
