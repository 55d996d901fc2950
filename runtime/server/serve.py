"""Run the server with uvicorn, draining on SIGTERM as Kubernetes expects.

On SIGTERM: `/ready` turns 503 (the pod leaves the Service), new requests get 503, in-flight
requests run to completion for up to `drain_timeout` seconds, then the server stops and the
process exits 0. A second SIGTERM, or SIGINT, stops at once (uvicorn's default).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType

import uvicorn

from kubeinfer.runtime.server.app import create_app
from kubeinfer.runtime.server.settings import ServerSettings
from kubeinfer.runtime.server.state import ServerState

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.state.draining:
            logger.info("SIGTERM: draining (up to %.0fs)", self.state.settings.drain_timeout)
            self.state.draining = True
            threading.Thread(target=self._drain, name="drain", daemon=True).start()
            return  # not captured: after a clean drain the process exits 0
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        deadline = time.monotonic() + self.state.settings.drain_timeout
        engine = self.state.engine
        while engine is not None and engine.num_unfinished and time.monotonic() < deadline:
            time.sleep(0.05)
        if engine is not None and engine.num_unfinished:
            logger.warning("drain timeout: %d requests still running", engine.num_unfinished)
        self.should_exit = True


def serve(settings: ServerSettings) -> None:
    state = ServerState(settings)
    app = create_app(settings, state)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=max(int(settings.drain_timeout), 1),
        access_log=False,
    )
    DrainingServer(config, state).run()
