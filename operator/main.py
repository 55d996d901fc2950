"""Run the operator: metrics endpoint, API client, reconciler, then kopf until stopped.

`run_operator(settings)` is the whole program behind `kubeinfer operator run`; tests and the
benchmark start it as a subprocess. It watches the namespaces in the settings (the whole
cluster when none), runs standalone unless peering is on, and serves kopf's liveness probe.
With leader election on it first waits, as a healthy standby, until it holds the Lease
(`leader.py`), acts while it renews it, and raises `LeaderLostError` (the process exits
non-zero and restarts as a standby) when it cannot; a clean stop releases the Lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator
from typing import Any

import kopf

from kubeinfer.operator.handlers import build_registry
from kubeinfer.operator.kube import ApiError, KubeApi
from kubeinfer.operator.leader import LeaseElector
from kubeinfer.operator.metrics import OperatorMetrics
from kubeinfer.operator.reconciler import Reconciler
from kubeinfer.operator.settings import OperatorSettings

logger = logging.getLogger(__name__)


class LeaderLostError(RuntimeError):
    """This replica could not renew its Lease in time and stopped acting."""


async def run_operator(
    settings: OperatorSettings,
    *,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
) -> None:
    metrics = OperatorMetrics()
    metrics.serve(settings.metrics_host, settings.metrics_port)
    api = await KubeApi.connect()
    elector = None
    if settings.leader_election:
        elector = LeaseElector(
            api,
            settings.leader_election_namespace,
            settings.leader_election_name,
            replica_identity(),
            duration_s=settings.lease_duration_s,
            renew_s=settings.lease_renew_s,
        )
        async with standby_health(settings):  # the kubelet's liveness probe while waiting
            await elector.acquire()
    metrics.is_leader.set(1)
    stop_flag = stop_flag or asyncio.Event()
    kept: asyncio.Task[None] | None = None
    if elector is not None:
        kept = asyncio.create_task(elector.keep(), name="kubeinfer-lease")
        kept.add_done_callback(lambda _: stop_flag.set())
    try:
        await _run_kopf(settings, api, metrics, stop_flag, ready_flag)
    finally:
        metrics.is_leader.set(0)
        if kept is not None and elector is not None:
            if kept.done() and not kept.cancelled():
                raise LeaderLostError("the Lease was not renewed in time: stopped acting")
            kept.cancel()
            await elector.release()


async def _run_kopf(
    settings: OperatorSettings,
    api: KubeApi,
    metrics: OperatorMetrics,
    stop_flag: asyncio.Event,
    ready_flag: asyncio.Event | None,
) -> None:
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


def replica_identity() -> str:
    """This replica's name in the Lease: the pod's name where there is one, and unique."""
    base = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}_{os.getpid()}_{secrets.token_hex(3)}"


@contextlib.asynccontextmanager
async def standby_health(settings: OperatorSettings) -> AsyncIterator[None]:
    """Answer GET /healthz with 200 on kopf's liveness address while this replica waits for
    the Lease (kopf serves it once it runs): a standby is healthy, not stuck."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nConnection: close\r\n\r\nstandby\n"
            )
            await writer.drain()
        writer.close()

    if not settings.liveness_port:
        yield
        return
    server = await asyncio.start_server(answer, settings.liveness_host, settings.liveness_port)
    try:
        yield
    finally:
        server.close()
        await server.wait_closed()


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
