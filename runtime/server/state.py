"""ServerState: what the routes need — the engine once loaded, load progress, draining.

The model loads on a background thread started by the app's lifespan, so the server answers
`/health` and `/ready` (with progress) from the first second; requests get 503 until then.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from kubeinfer.runtime.engine.async_engine import AsyncEngine
from kubeinfer.runtime.engine.engine import Engine
from kubeinfer.runtime.server.errors import APIError
from kubeinfer.runtime.server.metrics import RuntimeMetrics
from kubeinfer.runtime.server.settings import ServerSettings

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    settings: ServerSettings
    engine: AsyncEngine | None = None
    loaded_bytes: int = 0
    total_bytes: int = 0
    load_error: str | None = None
    draining: bool = False
    started: float = field(default_factory=time.time)
    num_in_flight: int = 0
    metrics: RuntimeMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RuntimeMetrics(
            self.settings.model_name, lambda: self.engine.engine if self.engine else None
        )

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_running and not self.draining

    def require_engine(self) -> AsyncEngine:
        """The engine, or a 503 saying why there is none."""
        if self.draining:
            raise APIError(503, "server is shutting down")
        if self.load_error is not None:
            raise APIError(503, f"model failed to load: {self.load_error}")
        if self.engine is None:
            raise APIError(503, "model is still loading")
        if not self.engine.is_running:
            raise APIError(503, f"engine stopped: {self.engine.error}")
        return self.engine

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
            async_engine = AsyncEngine(engine, on_finished=self.metrics.observe_finished)
            async_engine.start()
            self.engine = async_engine
            logger.info("model %s ready in %.1fs", s.model_name, time.monotonic() - start)
        except Exception as e:  # reported through /ready and /health, never a crash loop
            logger.exception("model load failed")
            self.load_error = str(e) or type(e).__name__
