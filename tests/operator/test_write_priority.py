"""WritePriority: deferred writes wait for urgent ones and a quiet gap, within bounds."""

from __future__ import annotations

import asyncio
import time

from kubeinfer.operator.write_priority import WritePriority


def test_deferred_runs_at_once_when_nothing_is_urgent() -> None:
    async def run() -> None:
        priority = WritePriority(quiet_s=5)
        started = time.monotonic()
        async with priority.deferred():
            pass
        assert time.monotonic() - started < 0.1

    asyncio.run(run())


def test_deferred_waits_for_urgent_writes_and_a_quiet_gap() -> None:
    async def run() -> None:
        priority = WritePriority(quiet_s=0.2)
        order: list[str] = []

        async def urgent(i: int) -> None:
            await asyncio.sleep(0.05 * i)
            async with priority.urgent():
                await asyncio.sleep(0.1)
                order.append(f"urgent {i}")

        async def deferred() -> None:
            await asyncio.sleep(0.01)
            async with priority.deferred():
                order.append("deferred")

        started = time.monotonic()
        await asyncio.gather(deferred(), *(urgent(i) for i in range(3)))
        assert order == ["urgent 0", "urgent 1", "urgent 2", "deferred"]
        # the last urgent write ends at 0.2 s, the quiet gap adds 0.2 s
        assert time.monotonic() - started >= 0.38

    asyncio.run(run())


def test_deferred_waits_at_most_max_wait() -> None:
    async def run() -> None:
        priority = WritePriority(quiet_s=0.1, max_wait_s=0.2)
        release = asyncio.Event()

        async def endless_urgent() -> None:
            async with priority.urgent():
                await release.wait()

        task = asyncio.create_task(endless_urgent())
        await asyncio.sleep(0)
        started = time.monotonic()
        async with priority.deferred():
            waited = time.monotonic() - started
        assert 0.15 <= waited < 0.5 and priority.num_urgent == 1
        release.set()
        await task
        assert priority.num_urgent == 0

    asyncio.run(run())


def test_at_most_max_deferred_run_at_once() -> None:
    async def run() -> None:
        priority = WritePriority(max_deferred=2)
        num_running = peak = 0

        async def deferred() -> None:
            nonlocal num_running, peak
            async with priority.deferred():
                num_running += 1
                peak = max(peak, num_running)
                await asyncio.sleep(0.02)
                num_running -= 1

        await asyncio.gather(*(deferred() for _ in range(6)))
        assert peak == 2

    asyncio.run(run())
