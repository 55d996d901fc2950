"""What a runtime pod says about itself on `/ready`: the load progress and the load error.

The kubelet's readiness probe only says ready or not; the runtime's `/ready` body says why
not (`{"status": "loading", "loaded_bytes", "total_bytes"}` or `{"status": "failed",
"error"}`), which is what the InferenceModel's conditions show. `parse_ready` is pure;
`read_ready` does the one bounded GET (to the pod IP, never a Service).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from kubeinfer.operator.pod_http import MAX_READY_BYTES, PodReadError, bounded_get

ReadyState = Literal["ready", "loading", "failed", "draining", "unreachable"]


@dataclass(slots=True, frozen=True)
class ReadyReport:
    """One reading of a pod's /ready."""

    state: ReadyState
    error: str = ""
    loaded_bytes: int = 0
    total_bytes: int = 0

    @property
    def progress(self) -> str:
        """`loaded 120 of 270 MB` (empty when the total is not known yet)."""
        if self.total_bytes <= 0:
            return ""
        mb = 1024 * 1024
        return f"loaded {self.loaded_bytes // mb} of {self.total_bytes // mb} MB"


def parse_ready(status_code: int, body: Any) -> ReadyReport:
    """The runtime's /ready answer (status code and JSON body) as a ReadyReport."""
    body = body if isinstance(body, dict) else {}
    if status_code == 200:
        return ReadyReport("ready")
    state = body.get("status")
    loaded = int(body.get("loaded_bytes") or 0)
    total = int(body.get("total_bytes") or 0)
    if state == "failed":
        return ReadyReport("failed", str(body.get("error") or "unknown error"), loaded, total)
    if state == "draining":
        return ReadyReport("draining", "", loaded, total)
    if state == "loading":
        return ReadyReport("loading", "", loaded, total)
    return ReadyReport("unreachable", f"/ready answered HTTP {status_code}")


async def read_ready(
    client: httpx.AsyncClient, pod_ip: str, port: int, timeout_s: float
) -> ReadyReport:
    """GET http://POD_IP:PORT/ready, bounded in size and time (`pod_http.py`); never raises
    (a failed or unbounded read is `unreachable`)."""
    url = f"http://{pod_ip}:{port}/ready"
    try:
        status_code, raw = await bounded_get(
            client, url, max_bytes=MAX_READY_BYTES, timeout_s=timeout_s
        )
    except PodReadError as exc:
        return ReadyReport("unreachable", str(exc))
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    return parse_ready(status_code, body)
