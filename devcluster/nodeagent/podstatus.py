"""A pod's status from its containers' states (pure): phase, conditions, container statuses.

Conditions keep their lastTransitionTime while their status does not change; PodScheduled is
the scheduler's and is left alone (the status is written as a strategic merge patch, which
merges conditions by type).
"""

from __future__ import annotations

from typing import Any, Literal

Phase = Literal["Pending", "Running", "Succeeded", "Failed"]


def pod_phase(
    *,
    is_initialized: bool,
    num_running: int,
    num_restarting: int,
    exit_codes: list[int | None],
) -> Phase:
    """The kubelet's phase rules for the main containers.

    `exit_codes` has one entry per container: its last exit code, or None when it never exited
    (or will be restarted); `num_restarting` counts containers waiting to be started again.
    """
    if not is_initialized:
        return "Pending"
    if num_running or num_restarting:
        return "Running"
    if exit_codes and all(code is not None for code in exit_codes):
        return "Succeeded" if all(code == 0 for code in exit_codes) else "Failed"
    return "Pending"


def conditions(
    previous: list[dict[str, Any]],
    *,
    is_initialized: bool,
    are_containers_ready: bool,
    has_sandbox: bool,
    now: str,
) -> list[dict[str, Any]]:
    """The agent's conditions, carrying over transition times that did not change."""
    before = {c.get("type"): c for c in previous}
    wanted = {
        "PodReadyToStartContainers": has_sandbox,
        "Initialized": is_initialized,
        "ContainersReady": are_containers_ready,
        "Ready": are_containers_ready,
    }
    out = []
    for ctype, value in wanted.items():
        status = "True" if value else "False"
        old = before.get(ctype)
        since = old["lastTransitionTime"] if old and old.get("status") == status else now
        cond: dict[str, Any] = {
            "type": ctype,
            "status": status,
            "lastTransitionTime": since,
            "lastProbeTime": None,
        }
        if not value and ctype in ("ContainersReady", "Ready"):
            cond["reason"] = "ContainersNotReady"
        else:
            cond["reason"] = None
        out.append(cond)
    return out


def pod_status(
    *,
    phase: Phase,
    conditions: list[dict[str, Any]],
    pod_ip: str,
    host_ip: str,
    start_time: str,
    container_statuses: list[dict[str, Any]],
    init_container_statuses: list[dict[str, Any]],
    reason: str | None = None,
    message: str | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": start_time,
        "containerStatuses": container_statuses,
        "reason": reason,
        "message": message,
    }
    if init_container_statuses:
        status["initContainerStatuses"] = init_container_statuses
    return status
