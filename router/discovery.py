"""Where the pods are: a static list (URLs, a file) or the model's ready pods from the API.

Each source answers `await source.backends()` with the whole current list, every discovery
interval: the router converges on it (level-triggered) whatever it missed before. The
Kubernetes source lists the pods by label selector with `resourceVersion=0`, which the API
server answers from its watch cache; dev-cluster pods have loopback IPs that EndpointSlices
reject, so pods, not slices, are the source (as `kubeinfer loadgen --selector` does).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Backend:
    """A routable pod: `name` labels metrics and decisions, `url` is its base URL."""

    name: str
    url: str


class BackendSource(Protocol):
    async def backends(self) -> list[Backend]: ...


class InvalidBackendError(ValueError):
    """A static backend that is not an http(s)://host:port URL."""


def parse_backend_url(url: str) -> Backend:
    """http://host:port[/] -> Backend named host:port."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise InvalidBackendError(f"{url!r}: want http://HOST:PORT")
    if parts.query or parts.fragment or parts.username:
        raise InvalidBackendError(f"{url!r}: want http://HOST:PORT")
    return Backend(parts.netloc, f"{parts.scheme}://{parts.netloc}")


def read_backends_file(path: Path) -> list[str]:
    """URLs in the file, one a line; blank lines and `#` comments skipped; missing: none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def ready_pod_backends(pods: list[dict[str, Any]], port: int) -> list[Backend]:
    """Pods (API JSON) that are Ready, not terminating and have an IP, sorted by name."""
    out = []
    for pod in pods:
        meta, status = pod.get("metadata", {}), pod.get("status", {})
        if meta.get("deletionTimestamp") or not status.get("podIP"):
            continue
        conditions = status.get("conditions") or []
        if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
            out.append(Backend(meta["name"], f"http://{status['podIP']}:{port}"))
    return sorted(out, key=lambda b: b.name)


class StaticSource:
    """`--backend` URLs plus the lines of `--backends-file`, re-read on every call; a line
    that is not a URL is logged and skipped (the rest still serve)."""

    def __init__(self, urls: list[str], path: Path | None = None) -> None:
        self.fixed = [parse_backend_url(u) for u in urls]
        self.path = path

    async def backends(self) -> list[Backend]:
        found = {b.name: b for b in self.fixed}
        for line in read_backends_file(self.path) if self.path else []:
            try:
                backend = parse_backend_url(line)
            except InvalidBackendError as exc:
                logger.warning("%s: %s", self.path, exc)
                continue
            found.setdefault(backend.name, backend)
        return list(found.values())


class KubePodSource:
    """The ready pods matching `selector` in `namespace`, through the operator's KubeApi."""

    def __init__(self, api: Any, namespace: str, selector: str, port: int) -> None:
        self.api, self.namespace, self.selector, self.port = api, namespace, selector, port

    async def backends(self) -> list[Backend]:
        body = await self.api.request(
            "GET",
            f"/api/v1/namespaces/{self.namespace}/pods",
            query={"labelSelector": self.selector, "resourceVersion": "0"},
        )
        return ready_pod_backends(body.get("items", []), self.port)
