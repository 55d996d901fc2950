"""Run the server with uvicorn, shutting down on SIGTERM without dropping work.

On SIGTERM, in three steps whose worst case is bounded by `shutdown_bound_s(settings)`:
1. for `shutdown_delay` seconds `/ready` answers 503 (the pod leaves the Service's endpoints)
   while requests are still served, since clients that have not seen the change yet still come;
2. then new requests get 503 and the ones in flight (streams included, each ending with
   `data: [DONE]`) run to completion for up to `drain_timeout` seconds;
3. then uvicorn closes the idle connections and the process exits 0.
A second SIGTERM, or SIGINT, stops at once (uvicorn's default). The operator renders a
`terminationGracePeriodSeconds` that covers the bound.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from types import FrameType

import uvicorn

from kubeinfer.runtime.server.app import create_app, create_probe_app
from kubeinfer.runtime.server.settings import ServerSettings
from kubeinfer.runtime.server.state import ENGINE_STOP_TIMEOUT_S, ServerState

logger = logging.getLogger(__name__)

#: After the drain: uvicorn's graceful close of the connections left, then the engine thread's
#: join (a step in progress ends first). Their sum bounds step 3.
CLOSE_TIMEOUT_S = 2
EXIT_MARGIN_S = CLOSE_TIMEOUT_S + ENGINE_STOP_TIMEOUT_S
#: How long a thread holds the GIL while another waits (Python's default is 5 ms). The event
#: loops wait behind the engine and tokenizer threads for it: shorter turns keep probe and
#: request latency low under load.
SWITCH_INTERVAL_S = 0.001


def shutdown_bound_s(settings: ServerSettings) -> float:
    """The longest SIGTERM can take to exit: the grace period must be at least this."""
    return settings.shutdown_delay + settings.drain_timeout + EXIT_MARGIN_S


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.state.draining:
            s = self.state.settings
            logger.info(
                "SIGTERM: serving %.0fs more while endpoints update, then draining (up to %.0fs)",
                s.shutdown_delay,
                s.drain_timeout,
            )
            self.state.draining = True
            threading.Thread(target=self._drain, name="drain", daemon=True).start()
            return  # not captured: after a clean drain the process exits 0
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        s = self.state.settings
        time.sleep(s.shutdown_delay)
        self.state.refusing = True
        deadline = time.monotonic() + s.drain_timeout
        while self.state.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.state.num_in_flight:
            logger.warning("drain timeout: %d requests still in flight", self.state.num_in_flight)
        self.should_exit = True


def start_probe_server(state: ServerState, port: int) -> threading.Thread:
    """The probe port: its own uvicorn server, thread and event loop. A flood of API requests
    queues on the main loop, not here; this one only waits its turn for the GIL. It needs no
    shutdown of its own: it answers (/ready: draining) until the process exits."""
    s = state.settings
    config = uvicorn.Config(
        create_probe_app(state),
        host=s.host,
        port=port,
        log_level=s.log_level,
        access_log=False,
        lifespan="off",
    )
    thread = threading.Thread(target=uvicorn.Server(config).run, name="probes", daemon=True)
    thread.start()
    return thread


def serve(settings: ServerSettings) -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    state = ServerState(settings)
    app = create_app(settings, state)
    if settings.probe_port is not None:
        start_probe_server(state, settings.probe_port)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
        access_log=False,
    )
    DrainingServer(config, state).run()
