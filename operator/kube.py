"""The operator's API calls: plain JSON dicts in and out, named errors, nothing else.

`KubeApi` sits on the kubernetes client's asyncio `ApiClient` (auth, TLS, connection pool) but
builds the request paths itself, so one `apply` serves every kind the operator renders and no
response is turned into generated model objects. Errors come back as `TransientApiError`
(retry: 5xx, 429, 409, 403, timeouts, connection failures), `RejectedError` (400/422: the
object itself is wrong, retrying cannot help) or `NotFoundError`.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes.aio import client as aio_client
from kubernetes.aio import config as aio_config
from kubernetes.aio.client.exceptions import ApiException

from kubeinfer.operator.manifests import API_VERSION, GROUP, KIND, PLURAL, VERSION

logger = logging.getLogger(__name__)

FIELD_MANAGER = "kubeinfer"
#: The Deployment's replicas when autoscaling is on: a separate manager owns that one field.
SCALE_FIELD_MANAGER = "kubeinfer-scale"
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
REQUEST_TIMEOUT_S = 30

#: kind -> (API path prefix, plural)
_KINDS: dict[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "InferencePool": ("/apis/inference.networking.k8s.io/v1", "inferencepools"),
    "Pod": ("/api/v1", "pods"),
    "Event": ("/api/v1", "events"),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
    "InferenceModel": (f"/apis/{GROUP}/{VERSION}", PLURAL),
}


class ApiError(RuntimeError):
    """An API call failed; `status` is the HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class TransientApiError(ApiError):
    """Worth retrying: the API server is busy, unreachable, conflicted or not yet allowing."""


class RejectedError(ApiError):
    """The API server refused the object itself (400/422); the message says which field."""


class NotFoundError(ApiError):
    """404."""


def object_path(kind: str, namespace: str, name: str | None = None, sub: str = "") -> str:
    prefix, plural = _KINDS[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name is not None:
        path += f"/{name}"
    return path + (f"/{sub}" if sub else "")


def _error(status: int, reason: str, body: str) -> ApiError:
    try:
        message = json.loads(body).get("message") or reason
    except (ValueError, AttributeError):
        message = body or reason
    text = f"HTTP {status}: {message}"
    if status == 404:
        return NotFoundError(status, text)
    if status in (400, 422):
        return RejectedError(status, text)
    return TransientApiError(status, text)


async def load_configuration() -> aio_client.Configuration:
    """$KUBECONFIG (the dev cluster gives every pod one), else in-cluster, else ~/.kube/config."""
    configuration = aio_client.Configuration()
    kubeconfig = os.environ.get("KUBECONFIG")
    token_file = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
    if not kubeconfig and token_file.exists():
        aio_config.load_incluster_config(client_configuration=configuration)
    else:
        await aio_config.load_kube_config(
            config_file=kubeconfig or None, client_configuration=configuration
        )
    configuration.connection_pool_maxsize = 32
    return configuration


class KubeApi:
    """Async JSON calls to the API server."""

    def __init__(self, api_client: aio_client.ApiClient) -> None:
        self.api_client = api_client

    @classmethod
    async def connect(cls) -> KubeApi:
        return cls(aio_client.ApiClient(await load_configuration()))

    async def close(self) -> None:
        await self.api_client.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: dict[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            params = await self.api_client.param_serialize(
                method=method,
                resource_path=path,
                query_params=list((query or {}).items()),
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = await self.api_client.call_api(*params, _request_timeout=REQUEST_TIMEOUT_S)
            raw = await response.read()
        except ApiException as exc:
            raise _error(int(exc.status or 0), str(exc.reason), str(exc.body or "")) from exc
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise TransientApiError(0, f"{method} {path}: {exc.__class__.__name__}: {exc}") from exc
        text = raw.decode(errors="replace") if raw else ""
        if not 200 <= response.status < 300:
            raise _error(response.status, str(response.reason), text)
        return json.loads(text) if text else {}

    async def apply(
        self, manifest: dict[str, Any], *, field_manager: str = FIELD_MANAGER, sub: str = ""
    ) -> dict[str, Any]:
        """Server-side apply (forced: the operator owns what it renders)."""
        meta = manifest["metadata"]
        return await self.request(
            "PATCH",
            object_path(manifest["kind"], meta["namespace"], meta["name"], sub),
            body=manifest,
            query={"fieldManager": field_manager, "force": "true"},
            content_type=APPLY,
        )

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", object_path(kind, namespace, name))
        except NotFoundError:
            return None

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete (background propagation); False when it was already gone."""
        try:
            await self.request(
                "DELETE",
                object_path(kind, namespace, name),
                body={"propagationPolicy": "Background"},
            )
        except NotFoundError:
            return False
        return True

    async def scale_deployment(self, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        return await self.request(
            "PATCH",
            object_path("Deployment", namespace, name, "scale"),
            body={"spec": {"replicas": replicas}},
            query={"fieldManager": SCALE_FIELD_MANAGER},
            content_type=MERGE,
        )

    async def create_event(
        self, obj: dict[str, Any], event_type: str, reason: str, message: str, component: str
    ) -> None:
        """A core/v1 Event about `obj` (an object with apiVersion, kind and metadata)."""
        meta = obj["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        body = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion"),
                "kind": obj.get("kind"),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": event_type,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": component},
            "reportingComponent": component,
            "reportingInstance": component,
            "firstTimestamp": now[:19] + "Z",
            "lastTimestamp": now[:19] + "Z",
            "count": 1,
        }
        await self.request("POST", object_path("Event", meta["namespace"]), body=body)

    async def scale_model(self, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """spec.replicas of an InferenceModel through its scale subresource."""
        return await self.request(
            "PATCH",
            object_path("InferenceModel", namespace, name, "scale"),
            body={"spec": {"replicas": replicas}},
            content_type=MERGE,
        )

    async def apply_model_status(
        self,
        namespace: str,
        name: str,
        status: dict[str, Any],
        *,
        field_manager: str = FIELD_MANAGER,
    ) -> dict[str, Any]:
        body = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": name, "namespace": namespace},
            "status": status,
        }
        return await self.apply(body, field_manager=field_manager, sub="status")
