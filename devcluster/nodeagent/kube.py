"""The node agent's few API calls, on the kubernetes client, with plain JSON dicts in and out.

The agent works on dicts shaped like the API's JSON (camelCase keys): they are what the pure
modules take, and what tests write by hand.
"""

from __future__ import annotations

import base64
import logging
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

logger = logging.getLogger(__name__)

SMP = "application/strategic-merge-patch+json"
AGENT_COMPONENT = "kubeinfer-node-agent"


class Kube:
    """Thin, thread-safe wrapper over CoreV1Api and CoordinationV1Api."""

    def __init__(self, kubeconfig: Path) -> None:
        api = config.new_client_from_config(config_file=str(kubeconfig))
        api.configuration.connection_pool_maxsize = 64
        self.api_client = api
        self.core = client.CoreV1Api(api)
        self.coordination = client.CoordinationV1Api(api)

    def to_dict(self, obj: Any) -> dict[str, Any]:
        return self.api_client.sanitize_for_serialization(obj)  # type: ignore[no-any-return]

    # --- pods -------------------------------------------------------------------------------

    def list_pods(self) -> tuple[list[dict[str, Any]], str]:
        pods = self.core.list_pod_for_all_namespaces()
        return [self.to_dict(p) for p in pods.items], pods.metadata.resource_version

    def watch_pods(
        self, resource_version: str, timeout_s: int = 300
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        w = watch.Watch()
        for event in w.stream(
            self.core.list_pod_for_all_namespaces,
            resource_version=resource_version,
            timeout_seconds=timeout_s,
            allow_watch_bookmarks=False,
        ):
            obj = event["object"]
            yield event["type"], obj if isinstance(obj, dict) else self.to_dict(obj)

    def patch_pod_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.core.patch_namespaced_pod_status(
            name, namespace, {"status": status}, _content_type=SMP
        )

    def delete_pod_now(self, namespace: str, name: str, uid: str) -> None:
        """Remove the pod object once its processes are gone (grace 0, only this incarnation)."""
        try:
            self.core.delete_namespaced_pod(
                name,
                namespace,
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)
                ),
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def event(self, pod: dict[str, Any], event_type: str, reason: str, message: str) -> None:
        meta = pod["metadata"]
        now = datetime.now(UTC)
        body = {
            "metadata": {
                "name": f"{meta['name']}.{secrets.token_hex(8)}",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "kind": "Pod",
                "apiVersion": "v1",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": event_type,
            "source": {"component": AGENT_COMPONENT, "host": pod["spec"].get("nodeName")},
            "reportingComponent": AGENT_COMPONENT,
            "reportingInstance": pod["spec"].get("nodeName") or "",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], body)
        except ApiException as exc:
            logger.warning(
                "event %s for %s/%s not recorded: %s",
                reason,
                meta["namespace"],
                meta["name"],
                exc.reason,
            )

    # --- credentials and config -------------------------------------------------------------

    def service_account_token(self, pod: dict[str, Any], ttl_s: int) -> str:
        """A TokenRequest for the pod's service account, bound to the pod (dies with it)."""
        meta, spec = pod["metadata"], pod["spec"]
        body = {
            "spec": {
                "expirationSeconds": ttl_s,
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            }
        }
        result = self.core.create_namespaced_service_account_token(
            spec.get("serviceAccountName") or "default", meta["namespace"], body
        )
        return str(result.status.token)

    def lookup(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        """A ConfigMap's or Secret's data (Secret values decoded), None when it does not exist."""
        try:
            if kind == "ConfigMap":
                return dict(self.core.read_namespaced_config_map(name, namespace).data or {})
            raw = self.core.read_namespaced_secret(name, namespace).data or {}
            return {k: base64.b64decode(v).decode(errors="replace") for k, v in raw.items()}
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
