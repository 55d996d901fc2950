"""The operator's work queue: which model to reconcile next (client-go's workqueue, for asyncio).

Watch events only `add` a key (namespace, name); `run(reconcile)` hands keys to a fixed number
of workers. Promises:

- Deduplication: a key waiting already is not queued twice (an urgent add promotes it).
- One reconcile per key at a time: a key added while its reconcile runs is queued again once
  that reconcile ends, never run beside it.
- A reconcile that raises is retried after `base_delay_s * 2**(failures - 1)` (at most
  `max_delay_s`), times a jitter in [0.5, 1.5); a successful one resets the count. One that
  returns a number of seconds is queued again after that long (`add_after`: one timer a key,
  the soonest, so reconciles that each ask to look again later do not multiply).
- Every `resync_s` every key `list_keys()` names is queued (what no event announced, e.g. an
  object that lost our labels, converges anyway).
- At most `num_workers` reconciles run at once, across keys.
- Two priorities. Urgent keys (a model without its Deployment: the write a user waits for)
  go first; other keys wait until no urgent key has been waiting or running for `quiet_s`, so a
  burst of new models gets every Deployment before the Services, status writes and events of
  any of them. A normal key waits at most `max_defer_s`: a steady stream of new models cannot
  starve the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable

logger = logging.getLogger(__name__)

Reconcile = Callable[[Hashable], Awaitable[float | None]]


class WorkQueue:
    def __init__(
        self,
        *,
        num_workers: int = 32,
        base_delay_s: float = 0.5,
        max_delay_s: float = 60.0,
        resync_s: float = 300.0,
        quiet_s: float = 0.5,
        max_defer_s: float = 30.0,
        list_keys: Callable[[], Iterable[Hashable]] = tuple,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.num_workers = num_workers
        self.base_delay_s, self.max_delay_s = base_delay_s, max_delay_s
        self.resync_s, self.quiet_s, self.max_defer_s = resync_s, quiet_s, max_defer_s
        self.list_keys, self.jitter = list_keys, jitter
        self._urgent: deque[Hashable] = deque()
        self._normal: deque[tuple[Hashable, float]] = deque()  # (key, when queued)
        self._waiting: dict[Hashable, bool] = {}  # key -> is urgent
        self._running: dict[Hashable, bool] = {}  # key -> was urgent
        self._dirty: dict[Hashable, bool] = {}  # added while running -> urgent
        self.failures: dict[Hashable, int] = {}
        self._last_urgent_end = -float("inf")
        self._wakeup = asyncio.Event()
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}  # add_after: key -> its timer
        self._tasks: list[asyncio.Task[None]] = []

    # --- adding --------------------------------------------------------------------------------

    def add(self, key: Hashable, *, urgent: bool = False) -> None:
        if key in self._running:
            self._dirty[key] = self._dirty.get(key, False) or urgent
            return
        was = self._waiting.get(key)
        if was is None:
            self._waiting[key] = urgent
            if urgent:
                self._urgent.append(key)
            else:
                self._normal.append((key, time.monotonic()))
        elif urgent and not was:  # promote (its normal entry is skipped when it comes up)
            self._waiting[key] = True
            self._urgent.append(key)
        else:
            return
        self._wakeup.set()

    def add_after(self, key: Hashable, delay_s: float) -> None:
        """Add `key` in `delay_s`; a key already due sooner keeps its time (one timer a key)."""
        loop = asyncio.get_running_loop()
        due = loop.time() + max(delay_s, 0.0)
        timer = self._timers.get(key)
        if timer is not None:
            if timer.when() <= due:
                return
            timer.cancel()

        def fire() -> None:
            del self._timers[key]
            self.add(key)

        self._timers[key] = loop.call_at(due, fire)

    def forget(self, key: Hashable) -> None:
        """Stop counting `key`'s failures (its object is gone, or it reconciled)."""
        self.failures.pop(key, None)

    def backoff_s(self, key: Hashable) -> float:
        """The delay before retrying `key` after its latest failure."""
        num = self.failures.get(key, 1)
        delay = min(self.base_delay_s * 2 ** (num - 1), self.max_delay_s)
        return float(delay * (0.5 + self.jitter()))

    def __len__(self) -> int:
        return len(self._waiting)

    # --- taking --------------------------------------------------------------------------------

    def is_quiet(self) -> bool:
        """No urgent key waits or runs, and none ended within `quiet_s`."""
        return (
            not self._urgent
            and not any(self._running.values())
            and time.monotonic() - self._last_urgent_end >= self.quiet_s
        )

    def _pop_ready(self) -> tuple[Hashable, bool] | None:
        """The next key to run, or None when none may run now."""
        while self._urgent:
            key = self._urgent.popleft()
            if self._waiting.get(key) is True:
                del self._waiting[key]
                return key, True
        while self._normal:
            key, since = self._normal[0]
            if self._waiting.get(key) is not False:  # promoted, or taken as urgent already
                self._normal.popleft()
                continue
            if not self.is_quiet() and time.monotonic() - since < self.max_defer_s:
                return None
            self._normal.popleft()
            del self._waiting[key]
            return key, False
        return None

    def _next_wake_s(self) -> float | None:
        """How long until a waiting normal key may run without an add (None: only an add)."""
        if not self._normal:
            return None
        now = time.monotonic()
        wake = self._normal[0][1] + self.max_defer_s - now
        if not self._urgent and not any(self._running.values()):
            wake = min(wake, self._last_urgent_end + self.quiet_s - now)
        return max(wake, 0.001)

    async def get(self) -> tuple[Hashable, bool]:
        """Wait for the next key; it counts as running until `done(key)`."""
        while True:
            taken = self._pop_ready()
            if taken is not None:
                self._running[taken[0]] = taken[1]
                return taken
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), self._next_wake_s())

    def done(self, key: Hashable) -> None:
        if self._running.pop(key, False):
            self._last_urgent_end = time.monotonic()
        dirty = self._dirty.pop(key, None)
        if dirty is not None:
            self.add(key, urgent=dirty)
        self._wakeup.set()

    # --- running -------------------------------------------------------------------------------

    async def _work(self, reconcile: Reconcile) -> None:
        while True:
            key, _ = await self.get()
            try:
                requeue_after = await reconcile(key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failed reconcile is retried, never fatal
                self.failures[key] = self.failures.get(key, 0) + 1
                delay = self.backoff_s(key)
                logger.warning("%s: reconcile failed (retry in %.1fs): %s", key, delay, exc)
                self.add_after(key, delay)
            else:
                self.forget(key)
                if requeue_after is not None:
                    self.add_after(key, requeue_after)
            finally:
                self.done(key)

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.resync_s)
            for key in list(self.list_keys()):
                self.add(key)

    def start(self, reconcile: Reconcile) -> None:
        """Start the workers and the resync (on the running loop); `close()` stops them."""
        self._tasks = [
            asyncio.create_task(self._work(reconcile), name=f"kubeinfer-worker-{i}")
            for i in range(self.num_workers)
        ]
        self._tasks.append(asyncio.create_task(self._resync(), name="kubeinfer-resync"))

    async def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
