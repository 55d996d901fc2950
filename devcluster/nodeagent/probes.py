"""Container probes: running one (httpGet, tcpSocket, exec) and tracking its result over time
with the kubelet's rules (initial delay, period, timeout, success/failure thresholds).

`ProbeTracker` is pure (time comes in as an argument), so the rules are tested without
processes or sleeps.
"""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

ProbeKind = Literal["startup", "readiness", "liveness"]


@dataclass(slots=True)
class ProbeResult:
    is_success: bool
    message: str


class ProbeTracker:
    """One probe of one container run (a restart gets a new tracker).

    Before its first result a readiness or startup probe counts as failed and a liveness probe
    as passed; the result flips only after `successThreshold` consecutive successes or
    `failureThreshold` consecutive failures.
    """

    def __init__(self, kind: ProbeKind, spec: dict[str, Any], started_at: float) -> None:
        self.kind = kind
        self.spec = spec
        self.initial_delay_s = float(spec.get("initialDelaySeconds") or 0)
        self.period_s = float(spec.get("periodSeconds") or 10)
        self.timeout_s = float(spec.get("timeoutSeconds") or 1)
        self.success_threshold = int(spec.get("successThreshold") or 1)
        self.failure_threshold = int(spec.get("failureThreshold") or 3)
        self.next_due = started_at + self.initial_delay_s
        self.is_success = kind == "liveness"
        self.has_result = False
        self.num_consecutive_successes = 0
        self.num_consecutive_failures = 0
        self.last_message = ""

    def is_due(self, now: float) -> bool:
        return now >= self.next_due

    def record(self, result: ProbeResult, now: float) -> bool:
        """Count a result; return True when the probe's overall result changed."""
        self.next_due = now + self.period_s
        self.last_message = result.message
        before = (self.is_success, self.has_result)
        if result.is_success:
            self.num_consecutive_successes += 1
            self.num_consecutive_failures = 0
            if self.num_consecutive_successes >= self.success_threshold:
                self.is_success, self.has_result = True, True
        else:
            self.num_consecutive_failures += 1
            self.num_consecutive_successes = 0
            if self.num_consecutive_failures >= self.failure_threshold:
                self.is_success, self.has_result = False, True
        return (self.is_success, self.has_result) != before

    @property
    def has_failed(self) -> bool:
        """True once the failure threshold was reached (startup and liveness kill on it)."""
        return self.has_result and not self.is_success


def resolve_port(port: int | str, container: dict[str, Any]) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"probe port {port!r} names no port of container {container.get('name')!r}")


def run_probe(
    spec: dict[str, Any],
    *,
    container: dict[str, Any],
    pod_ip: str,
    env: dict[str, str],
    cwd: Path,
    timeout_s: float,
) -> ProbeResult:
    """Run one probe once. Never raises: every problem is a failed result with a message."""
    try:
        if "httpGet" in spec:
            return _http_get(spec["httpGet"], container, pod_ip, timeout_s)
        if "tcpSocket" in spec:
            return _tcp(spec["tcpSocket"], container, pod_ip, timeout_s)
        if "exec" in spec:
            return _exec(spec["exec"].get("command") or [], env, cwd, timeout_s)
        return ProbeResult(False, f"probe handler {sorted(spec)} not supported")
    except Exception as exc:  # noqa: BLE001 - a probe that cannot run has failed
        return ProbeResult(False, f"{exc.__class__.__name__}: {exc}")


def _http_get(
    get: dict[str, Any], container: dict[str, Any], pod_ip: str, timeout_s: float
) -> ProbeResult:
    host = get.get("host") or pod_ip
    port = resolve_port(get.get("port", 80), container)
    path = get.get("path") or "/"
    scheme = (get.get("scheme") or "HTTP").lower()
    headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
    headers.setdefault("User-Agent", "kube-probe/dev")
    url = f"{scheme}://{host}:{port}{path if path.startswith('/') else '/' + path}"
    try:
        # kubelet does not verify probe certificates either
        resp = httpx.get(url, headers=headers, timeout=timeout_s, verify=False)
    except httpx.HTTPError as exc:
        return ProbeResult(False, f"GET {url}: {exc.__class__.__name__}: {exc}")
    ok = 200 <= resp.status_code < 400
    return ProbeResult(ok, f"GET {url}: HTTP {resp.status_code}")


def _tcp(
    tcp: dict[str, Any], container: dict[str, Any], pod_ip: str, timeout_s: float
) -> ProbeResult:
    host = tcp.get("host") or pod_ip
    port = resolve_port(tcp["port"], container)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return ProbeResult(True, f"tcp {host}:{port}: connected")
    except OSError as exc:
        return ProbeResult(False, f"tcp {host}:{port}: {exc}")


def _exec(command: list[str], env: dict[str, str], cwd: Path, timeout_s: float) -> ProbeResult:
    if not command:
        return ProbeResult(False, "exec probe without a command")
    try:
        done = subprocess.run(
            command,
            env=env,
            cwd=cwd,
            capture_output=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        return ProbeResult(False, f"exec {command[0]}: timed out after {timeout_s:.0f}s")
    except OSError as exc:
        return ProbeResult(False, f"exec {command[0]}: {exc}")
    output = (done.stdout + done.stderr).decode(errors="replace").strip()[-200:]
    return ProbeResult(done.returncode == 0, f"exec {command[0]}: exit {done.returncode} {output}")
