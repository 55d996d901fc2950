"""Run the operator: metrics endpoint, API client, reconciler, then kopf until stopped.

`run_operator(settings)` is the whole program behind `kubeinfer operator run`; tests and the
benchmark start it as a subprocess. It watches the namespaces in the settings (the whole
cluster when none), runs standalone unless peering is on, and serves kopf's liveness probe.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from kubeinfer.operator.handlers import build_registry
from kubeinfer.operator.kube import ApiError, KubeApi
from kubeinfer.operator.metrics import OperatorMetrics
from kubeinfer.operator.reconciler import Reconciler
from kubeinfer.operator.settings import OperatorSettings

logger = logging.getLogger(__name__)


async def run_operator(
    settings: OperatorSettings,
    *,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
) -> None:
    metrics = OperatorMetrics()
    metrics.serve(settings.metrics_host, settings.metrics_port)
    api = await KubeApi.connect()
    if settings.peering:
        await ensure_peering(api, settings)
    reconciler = Reconciler(api, settings, metrics)
    memo = kopf.Memo(reconciler=reconciler)
    liveness = (
        f"http://{settings.liveness_host}:{settings.liveness_port}/healthz"
        if settings.liveness_port
        else None
    )
    logger.info(
        "kubeinfer operator: %s, runtime image %s, %s",
        "cluster-wide" if settings.is_clusterwide else f"namespaces {settings.namespaces}",
        settings.runtime_image,
        f"peering {settings.peering_name!r}" if settings.peering else "standalone",
    )
    await kopf.operator(
        registry=build_registry(settings),
        clusterwide=settings.is_clusterwide,
        namespaces=settings.namespaces,
        standalone=not settings.peering,
        # kopf makes peering mandatory whenever a peering name is given
        peering_name=settings.peering_name if settings.peering else None,
        priority=settings.priority,
        liveness_endpoint=liveness,
        memo=memo,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )


async def ensure_peering(api: KubeApi, settings: OperatorSettings) -> None:
    """Create the (Cluster)KopfPeering object the replicas share when it is missing: kopf
    waits for it, paused, otherwise. Needs crds/kopf-peering.yaml installed."""
    body: dict[str, Any] = {
        "apiVersion": "kopf.dev/v1",
        "metadata": {"name": settings.peering_name},
    }
    if settings.is_clusterwide:
        targets = [("/apis/kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering")]
    else:
        targets = [
            (f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings", "KopfPeering")
            for ns in settings.namespaces
        ]
    for path, kind in targets:
        try:
            await api.request("POST", path, body={**body, "kind": kind})
            logger.info("created %s %s", kind, settings.peering_name)
        except ApiError as exc:
            if exc.status != 409:  # 409: it exists already
                logger.warning("cannot create %s %s: %s", kind, settings.peering_name, exc)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # kopf logs every handler invocation at INFO; its warnings and errors are what matter.
    kopf_level = logging.DEBUG if level == "debug" else logging.WARNING
    logging.getLogger("kopf").setLevel(kopf_level)
