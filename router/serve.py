"""Run the router with uvicorn. On SIGTERM it stops accepting and lets the requests in flight
(streams included) finish for up to `drain_timeout_s` (uvicorn's graceful shutdown)."""

from __future__ import annotations

import uvicorn

from kubeinfer.router.app import create_app
from kubeinfer.router.settings import RouterSettings


def serve(settings: RouterSettings) -> None:
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
        access_log=False,
    )
    uvicorn.Server(config).run()
