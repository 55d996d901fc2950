"""kopf wiring: every watch event goes to `Reconciler.observe`, which queues the model's key.

`build_registry(settings)` registers, on a registry of its own (never kopf's global one):
startup/cleanup/login/probe activities; silent watches (`kopf.on.event`: kopf writes nothing to
the objects, no annotations, no status) of InferenceModels (created, changed, deleted, and every
one listed when the operator starts), of their children (Deployments, Services, PDBs, and the
router's ServiceAccounts, Roles and RoleBindings), of their ReplicaSets and of their pods
(children, ReplicaSets and pods by our label); and, for models with `spec.autoscaling.enabled`,
the autoscaler's per-model daemon from `autoscale_daemon.py`, the one handler that makes kopf
add a finalizer. What happens then is the reconciler's (`reconciler.py`): retries, resync and
ordering are its queue's.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kubeinfer.operator.autoscale_daemon import autoscale_daemon, autoscaling_enabled
from kubeinfer.operator.manifests import GROUP, KIND, MANAGED_BY, MANAGED_BY_LABEL, PLURAL, VERSION
from kubeinfer.operator.reconciler import Reconciler
from kubeinfer.operator.settings import OperatorSettings

logger = logging.getLogger(__name__)

FINALIZER = "kubeinfer.dev/operator"
OURS = {MANAGED_BY_LABEL: MANAGED_BY}
OURS_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
#: The children's, ReplicaSets' and pods' resources as kopf selectors.
WATCHED: tuple[tuple[str, ...], ...] = (
    ("apps", "v1", "deployments"),
    ("v1", "services"),
    ("policy", "v1", "poddisruptionbudgets"),
    # the router's (routing mode router)
    ("v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    # routing mode inferencePool (a cluster without the CRD has none to watch)
    ("inference.networking.k8s.io", "v1", "inferencepools"),
    # pods are matched to models through their ReplicaSet's owner (the model's Deployment)
    ("apps", "v1", "replicasets"),
    ("v1", "pods"),
)


def _plain(body: Any) -> dict[str, Any]:
    """kopf's Body view as the plain dict the pure code takes."""
    return {k: body[k] for k in body}


def _reconciler(memo: Any) -> Reconciler:
    return memo["reconciler"]  # type: ignore[no-any-return]


def build_registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    model = (GROUP, VERSION, PLURAL)

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER  # only the autoscaling daemon needs one
        settings.posting.reporting_component = "kubeinfer-operator"
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 60
        for resource in WATCHED:
            settings.watching.label_selectors[resource] = OURS_SELECTOR
        _reconciler(memo).start()

    @kopf.on.cleanup(registry=registry)
    async def close(memo: Any, **_: Any) -> None:
        await _reconciler(memo).close()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # $KUBECONFIG first: the dev cluster hands every pod a kubeconfig with its token.
        return kopf.login_with_kubeconfig(**kwargs) or kopf.login_with_service_account(**kwargs)

    @kopf.on.probe(id="models", registry=registry)
    def num_models(memo: Any, **_: Any) -> int:
        return len(_reconciler(memo).store.models)

    @kopf.on.event(*model, registry=registry)
    async def model_event(type: str | None, body: Any, memo: Any, **_: Any) -> None:
        _reconciler(memo).observe(KIND, type, _plain(body))

    for resource in WATCHED:

        @kopf.on.event(*resource, labels=OURS, registry=registry)
        async def watched_event(type: str | None, body: Any, memo: Any, **_: Any) -> None:
            _reconciler(memo).observe(body["kind"], type, _plain(body))

    # On deletion (or autoscaling turned off) the daemon gets 1 s to leave by itself, then is
    # cancelled: without this kopf only looks again after a minute, holding the finalizer.
    kopf.daemon(
        *model,
        when=autoscaling_enabled,
        cancellation_backoff=1.0,
        cancellation_timeout=5.0,
        registry=registry,
    )(autoscale_daemon)
    return registry
