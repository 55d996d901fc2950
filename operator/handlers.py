"""kopf wiring: which watch events reach the `Reconciler`, and with which retry policy.

`build_registry(settings)` registers, on a registry of its own (never kopf's global one):
startup/cleanup/login/probe activities; create/update/resume of InferenceModels, each one
apply (transient API errors become `kopf.TemporaryError`, so kopf retries with backoff); silent
watches of models, of their children (Deployments, Services, PDBs: drift repair), of their
ReplicaSets and pods (status; pods are matched to models through the ReplicaSets' owners);
and, for models with `spec.autoscaling.enabled`, the autoscaler's per-model daemon from
`autoscale_daemon.py`. A model blocked by an object it does not own is retried every
`NOT_OWNED_RETRY_S`. Handlers return nothing, so kopf writes nothing to status.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kubeinfer.operator.autoscale_daemon import autoscale_daemon, autoscaling_enabled
from kubeinfer.operator.kube import TransientApiError
from kubeinfer.operator.manifests import GROUP, MANAGED_BY, MANAGED_BY_LABEL, PLURAL, VERSION
from kubeinfer.operator.reconciler import NotOwnedError, Reconciler
from kubeinfer.operator.settings import OperatorSettings

logger = logging.getLogger(__name__)

ANNOTATION_PREFIX = "kubeinfer.dev"
FINALIZER = "kubeinfer.dev/operator"
OURS = {MANAGED_BY_LABEL: MANAGED_BY}
OURS_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
RETRY_DELAY_S = 5.0
#: A model blocked by another's object looks again this often (it is Failed meanwhile).
NOT_OWNED_RETRY_S = 30.0
#: The children's and pods' resources as kopf selectors.
CHILDREN: tuple[tuple[str, ...], ...] = (
    ("apps", "v1", "deployments"),
    ("v1", "services"),
    ("policy", "v1", "poddisruptionbudgets"),
)
PODS = ("v1", "pods")
#: Pods are matched to models through their ReplicaSet's owner (the model's Deployment).
REPLICASETS = ("apps", "v1", "replicasets")


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
        p = settings.persistence
        p.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
        p.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
        )
        p.finalizer = FINALIZER  # only the autoscaling daemon needs one
        settings.posting.reporting_component = "kubeinfer-operator"
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 60
        for child in (*CHILDREN, PODS, REPLICASETS):
            settings.watching.label_selectors[child] = OURS_SELECTOR
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
        return len(_reconciler(memo).models)

    @kopf.on.event(*model, registry=registry)
    async def model_event(type: str | None, body: Any, memo: Any, **_: Any) -> None:
        _reconciler(memo).observe_model(type, _plain(body))

    async def apply(body: Any, memo: Any) -> None:
        try:
            await _reconciler(memo).apply(_plain(body))
        except TransientApiError as exc:
            raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY_S) from exc
        except NotOwnedError as exc:
            raise kopf.TemporaryError(str(exc), delay=NOT_OWNED_RETRY_S) from exc

    @kopf.on.resume(*model, registry=registry)
    async def resumed(body: Any, memo: Any, **_: Any) -> None:
        await apply(body, memo)

    @kopf.on.create(*model, registry=registry)
    async def created(body: Any, memo: Any, **_: Any) -> None:
        await apply(body, memo)

    @kopf.on.update(*model, field="spec", registry=registry)
    async def updated(body: Any, memo: Any, **_: Any) -> None:
        await apply(body, memo)

    for child in CHILDREN:

        @kopf.on.event(*child, labels=OURS, registry=registry)
        async def child_event(type: str | None, body: Any, memo: Any, **_: Any) -> None:
            _reconciler(memo).observe_child(type, _plain(body))

    @kopf.on.event(*REPLICASETS, labels=OURS, registry=registry)
    async def replicaset_event(type: str | None, body: Any, memo: Any, **_: Any) -> None:
        _reconciler(memo).observe_replicaset(type, _plain(body))

    @kopf.on.event(*PODS, labels=OURS, registry=registry)
    async def pod_event(type: str | None, body: Any, memo: Any, **_: Any) -> None:
        _reconciler(memo).observe_pod(type, _plain(body))

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
