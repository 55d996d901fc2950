"""create_app(settings): the router's ASGI app — /v1 through the proxy, /health, /ready,
/metrics — and, in its lifespan, the two loops that keep the view current.

- Discovery: every `discovery_interval_s` the source lists the backends and the state takes
  the list as it is (a failed listing keeps the last view and logs). /ready answers 200 once a
  listing has succeeded, with or without pods: the router must take requests at zero pods to
  hold them.
- Scrape: every `scrape_interval_s`, each pod's /metrics, concurrently, each read bounded in
  size and time and parsed by the operator's scraper (`kubeinfer.operator.scrape`); a failed
  read marks that pod stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kubeinfer.operator.autoscale_types import PodTarget
from kubeinfer.operator.scrape import scrape_pods
from kubeinfer.router.discovery import BackendSource, KubePodSource, StaticSource
from kubeinfer.router.proxy import Proxy
from kubeinfer.router.settings import RouterSettings
from kubeinfer.router.state import RouterState

if TYPE_CHECKING:
    from kubeinfer.operator.kube import KubeApi

logger = logging.getLogger(__name__)


async def discovery_loop(source: BackendSource, state: RouterState) -> None:
    while True:
        try:
            state.set_backends(await source.backends())
        except Exception as exc:  # any failure: keep the last view, try again
            logger.warning("listing backends failed, keeping the last view: %s", exc)
        await asyncio.sleep(state.settings.discovery_interval_s)


async def scrape_loop(client: httpx.AsyncClient, state: RouterState) -> None:
    s = state.settings
    while True:
        targets = [
            PodTarget(p.backend.name, f"{p.backend.url}/metrics") for p in state.pods.values()
        ]
        try:
            samples = await scrape_pods(
                client, targets, timeout_s=s.scrape_timeout_s, model_name=s.model_name
            )
        except Exception:  # a bug here must not freeze the view: log it, scrape again
            logger.exception("scraping the pods failed")
        else:
            state.apply_samples(samples)
        await asyncio.sleep(s.scrape_interval_s)


class RouterApp:
    """/v1/* to the proxy, everything else (probes, metrics, lifespan) to Starlette."""

    def __init__(self, settings: RouterSettings, source: BackendSource | None = None) -> None:
        self.settings = settings
        self.state = RouterState(settings)
        self.source = source
        timeout = httpx.Timeout(
            settings.upstream_timeout_s,
            connect=settings.connect_timeout_s,
            pool=settings.connect_timeout_s,
        )
        limits = httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_connections,
        )
        # no environment proxies: pod IPs are reached directly
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
        self.proxy = Proxy(self.state, self.client)
        self.probes = Starlette(
            routes=[
                Route("/health", self._health),
                Route("/ready", self._ready),
                Route("/metrics", self._metrics),
            ],
            lifespan=self._lifespan,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            await self.proxy(scope, receive, send)
        else:
            await self.probes(scope, receive, send)

    async def _health(self, _: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _ready(self, _: Request) -> Response:
        ready = self.state.has_synced
        body = {"ready": ready, "num_pods": len(self.state.pods), "num_held": len(self.state.hold)}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def _metrics(self, _: Request) -> Response:
        return Response(self.state.metrics.render(), media_type="text/plain; version=0.0.4")

    @asynccontextmanager
    async def _lifespan(self, _: Starlette) -> AsyncIterator[None]:
        kube = None
        if self.source is None:
            self.source, kube = await make_source(self.settings)
        scrape_client = httpx.AsyncClient(trust_env=False)
        tasks = [
            asyncio.create_task(discovery_loop(self.source, self.state), name="discovery"),
            asyncio.create_task(scrape_loop(scrape_client, self.state), name="scrape"),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await scrape_client.aclose()
            await self.client.aclose()
            if kube is not None:
                await kube.close()


async def make_source(settings: RouterSettings) -> tuple[BackendSource, KubeApi | None]:
    """The settings' backend source; with a selector also the KubeApi to close at the end."""
    if settings.selector:
        from kubeinfer.operator.kube import KubeApi

        api = await KubeApi.connect()
        return KubePodSource(api, settings.namespace, settings.selector, settings.pod_port), api
    return StaticSource(settings.backends, settings.backends_file), None


def create_app(settings: RouterSettings, source: BackendSource | None = None) -> RouterApp:
    return RouterApp(settings, source)
