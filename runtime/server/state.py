"""ServerState: what the routes need — the engine once loaded, limits, admission, shutdown.

The model loads on a background thread started by the app's lifespan, so the server answers
`/health` and `/ready` (with progress) from the first second; requests get 503 until then.
CPU work a request brings (tokenizing, rendering a chat template) runs on a small thread pool
(`run_cpu`), never on the event loop, so probes and scrapes answer while large bodies are
handled.

Shutdown has two steps: `draining` (readiness fails, requests are still served while endpoints
drop the pod) and then `refusing` (new requests get 503; those in flight finish).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from kubeinfer.runtime.engine.async_engine import AsyncEngine
from kubeinfer.runtime.engine.engine import Engine
from kubeinfer.runtime.server.admission import Admission, QueueView
from kubeinfer.runtime.server.errors import APIError
from kubeinfer.runtime.server.limits import MIN_REQUEST_BYTES, RequestLimits
from kubeinfer.runtime.server.metrics import RuntimeMetrics
from kubeinfer.runtime.server.settings import ServerSettings

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: How long shutdown waits for the engine thread (a step in progress ends first).
ENGINE_STOP_TIMEOUT_S = 5.0


@dataclass
class ServerState:
    settings: ServerSettings
    engine: AsyncEngine | None = None
    limits: RequestLimits | None = None
    loaded_bytes: int = 0
    total_bytes: int = 0
    load_error: str | None = None
    draining: bool = False
    """SIGTERM seen: /ready fails; requests are still served until `refusing`."""
    refusing: bool = False
    """New requests get 503 (in-flight ones finish)."""
    started: float = field(default_factory=time.time)
    num_in_flight: int = 0
    """/v1 requests between arrival and their response's last byte."""
    metrics: RuntimeMetrics = field(init=False)
    admission: Admission = field(init=False)
    cpu_pool: ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RuntimeMetrics(
            self.settings.model_name, lambda: self.engine.engine if self.engine else None
        )
        self.admission = Admission(self.metrics.observe_rejected)
        self.cpu_pool = ThreadPoolExecutor(
            self.settings.tokenizer_workers, thread_name_prefix="tokenize"
        )

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_running and not self.draining

    @property
    def max_request_bytes(self) -> int:
        if self.limits is not None:
            return self.limits.max_request_bytes
        return self.settings.max_request_bytes or MIN_REQUEST_BYTES

    def require_engine(self) -> tuple[AsyncEngine, RequestLimits]:
        """The engine and the limits, or a 503 saying why there is none."""
        if self.refusing:
            raise APIError(503, "server is shutting down")
        if self.load_error is not None:
            raise APIError(503, f"model failed to load: {self.load_error}")
        if self.engine is None or self.limits is None:
            raise APIError(503, "model is still loading")
        if not self.engine.is_running:
            raise APIError(503, f"engine stopped: {self.engine.error}")
        return self.engine, self.limits

    def queue_full(self) -> str | None:
        """The 429 message when the waiting queue has no room for one more request."""
        if self.limits is None:
            return None
        return self.admission.full(self.engine_queue(), self.limits)

    def engine_queue(self) -> QueueView:
        engine = self.engine
        if engine is None:
            return QueueView(0, 0)
        return QueueView(engine.num_queued, engine.num_queued_tokens)

    async def run_cpu(self, fn: Callable[..., T], *args: object) -> T:
        """Run a request's CPU work (tokenizing, templating) on the pool, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, fn, *args)

    def stalled_for(self) -> float | None:
        """Seconds the engine has had work without finishing a step, when over the timeout."""
        if self.engine is None:
            return None
        seconds = self.engine.seconds_since_progress
        return seconds if seconds > self.settings.engine_stall_timeout else None

    def load_in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self._load, name="model-load", daemon=True)
        thread.start()
        return thread

    def _load(self) -> None:
        s = self.settings

        def progress(done: int, total: int) -> None:
            self.loaded_bytes, self.total_bytes = done, total

        try:
            start = time.monotonic()
            engine = Engine(
                s.model, s.engine_config(), dtype=s.dtype, device=s.device, on_progress=progress
            )
            try:
                limits = RequestLimits.from_settings(s, engine.max_model_len)
            except BaseException:
                engine.close()  # its tensor-parallel workers, if any
                raise
            async_engine = AsyncEngine(engine, on_finished=self.metrics.observe_finished)
            async_engine.start()
            self.limits = limits
            # Everything loaded so far lives as long as the process: out of the collector's
            # sight, a full collection no longer walks it (it paused every thread 100-190 ms
            # under a flood of requests)
            gc.collect()
            gc.freeze()
            self.engine = async_engine
            logger.info("model %s ready in %.1fs", s.model_name, time.monotonic() - start)
        except Exception as e:  # reported through /ready and /health, never a crash loop
            logger.exception("model load failed")
            self.load_error = str(e) or type(e).__name__

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop(ENGINE_STOP_TIMEOUT_S)
        self.cpu_pool.shutdown(wait=False, cancel_futures=True)
        gc.unfreeze()  # an exit that collects as usual (extensions report frozen ones as leaks)
