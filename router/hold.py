"""The hold queue: requests that arrived while no pod was ready wait here, in arrival order.

Bounded twice: `pick` refuses to hold past `max_held` (the caller passes `len(queue)`), and
each waiter gives up after its own timeout. `release_all` wakes every waiter in the order they
came (asyncio runs the woken tasks first-in, first-out), and each then picks a pod afresh. A
waiter whose client leaves is cancelled and leaves the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class HoldQueue:
    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, timeout_s: float) -> bool:
        """Wait for `release_all`; False when `timeout_s` passed first."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            async with asyncio.timeout(timeout_s):
                await future
            return True
        except TimeoutError:
            return False
        finally:
            if not future.done():
                future.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(future)

    def release_all(self) -> int:
        """Wake every waiter, oldest first; the number woken."""
        num_woken = 0
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                future.set_result(None)
                num_woken += 1
        return num_woken
