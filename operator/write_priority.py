"""Which of the operator's API writes go first: a model's missing Deployment before the rest.

Under a burst of new InferenceModels the API server is the bottleneck, and every model costs
several writes besides its Deployment (Service, status, events, kopf's annotation patch, which
kopf makes once the create handler returns). Sent in arrival order, the 500th model's
Deployment waits behind ~2,000 writes that nobody is waiting for. `WritePriority` orders them:

- `urgent()` wraps a write that creates a missing Deployment. It never waits.
- `deferred()` wraps every other write. It waits until no urgent write has been in flight for
  `quiet_s` (the gap between one create and the next of a burst), and at most `max_deferred`
  run at once, so urgent writes always find free connections in the client's pool (32). A
  deferred write waits at most `max_wait_s`: a steady stream of new models cannot starve
  Services, status and events.

Without a burst there is nothing urgent in flight, and `deferred()` costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

QUIET_S = 0.5
MAX_WAIT_S = 30.0
MAX_DEFERRED = 16


class WritePriority:
    def __init__(
        self,
        *,
        quiet_s: float = QUIET_S,
        max_wait_s: float = MAX_WAIT_S,
        max_deferred: int = MAX_DEFERRED,
    ) -> None:
        self.quiet_s = quiet_s
        self.max_wait_s = max_wait_s
        self.num_urgent = 0
        self._last_urgent_end = -float("inf")
        self._slots = asyncio.Semaphore(max_deferred)
        self._no_urgent = asyncio.Event()
        self._no_urgent.set()

    @contextlib.asynccontextmanager
    async def urgent(self) -> AsyncIterator[None]:
        self.num_urgent += 1
        self._no_urgent.clear()
        try:
            yield
        finally:
            self.num_urgent -= 1
            self._last_urgent_end = time.monotonic()
            if self.num_urgent == 0:
                self._no_urgent.set()

    @contextlib.asynccontextmanager
    async def deferred(self) -> AsyncIterator[None]:
        async with self._slots:
            await self._wait_quiet()
            yield

    def is_quiet(self) -> bool:
        return self.num_urgent == 0 and time.monotonic() - self._last_urgent_end >= self.quiet_s

    async def _wait_quiet(self) -> None:
        deadline = time.monotonic() + self.max_wait_s
        while not self.is_quiet():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self.num_urgent:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._no_urgent.wait(), left)
            else:
                quiet_for = time.monotonic() - self._last_urgent_end
                await asyncio.sleep(min(self.quiet_s - quiet_for, left))
