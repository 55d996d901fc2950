"""WorkQueue: dedupe, one reconcile per key at a time, backoff with jitter, requeue, resync,
urgent keys first, bounded concurrency. Short real waits (tens of ms), no cluster."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable

from kubeinfer.operator.workqueue import WorkQueue


def run(queue: WorkQueue, reconcile: Callable[[Hashable], Awaitable[float | None]],
        body: Callable[[], Awaitable[None]]) -> None:  # fmt: skip
    async def main() -> None:
        queue.start(reconcile)
        try:
            await body()
        finally:
            await queue.close()

    asyncio.run(main())


async def until(check: Callable[[], bool], timeout_s: float = 2.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.005)


def test_a_key_added_many_times_while_waiting_runs_once() -> None:
    queue = WorkQueue(num_workers=1)
    seen: list[Hashable] = []

    async def reconcile(key: Hashable) -> None:
        seen.append(key)

    for _ in range(5):
        queue.add("a")
    queue.add("b")
    assert len(queue) == 2

    async def body() -> None:
        await until(lambda: len(seen) == 2)
        await asyncio.sleep(0.02)

    run(queue, reconcile, body)
    assert seen == ["a", "b"]


def test_one_reconcile_per_key_at_a_time_and_an_add_meanwhile_runs_after() -> None:
    queue = WorkQueue(num_workers=4)
    release = asyncio.Event()
    running: set[Hashable] = set()
    num_runs = 0
    overlaps = 0

    async def reconcile(key: Hashable) -> None:
        nonlocal num_runs, overlaps
        overlaps += key in running
        running.add(key)
        num_runs += 1
        if num_runs == 1:
            await release.wait()
        running.discard(key)

    async def body() -> None:
        queue.add("a")
        await until(lambda: num_runs == 1)
        queue.add("a")  # while it runs: not beside it, but once more after it
        queue.add("a")
        await asyncio.sleep(0.02)
        assert num_runs == 1
        release.set()
        await until(lambda: num_runs == 2)
        await asyncio.sleep(0.02)

    run(queue, reconcile, body)
    assert overlaps == 0 and num_runs == 2


def test_a_failure_is_retried_with_exponential_backoff_and_jitter() -> None:
    queue = WorkQueue(num_workers=1, base_delay_s=0.02, max_delay_s=0.08, jitter=lambda: 0.5)
    queue.failures["k"] = 1
    assert queue.backoff_s("k") == 0.02  # jitter 0.5: x1.0
    queue.failures["k"] = 4
    assert queue.backoff_s("k") == 0.08  # capped
    queue.forget("k")
    times: list[float] = []

    async def reconcile(key: Hashable) -> None:
        times.append(asyncio.get_running_loop().time())
        if len(times) < 4:
            raise RuntimeError("API busy")

    async def body() -> None:
        queue.add("k")
        await until(lambda: len(times) == 4)

    run(queue, reconcile, body)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert [round(g, 2) >= d for g, d in zip(gaps, (0.02, 0.04, 0.08), strict=True)] == [True] * 3
    assert queue.failures == {}  # reset by the success


def test_a_requeue_after_runs_the_key_again_later() -> None:
    queue = WorkQueue(num_workers=1)
    num_runs = 0

    async def reconcile(_: Hashable) -> float | None:
        nonlocal num_runs
        num_runs += 1
        return 0.02 if num_runs < 3 else None

    async def body() -> None:
        queue.add("k")
        await until(lambda: num_runs == 3)
        await asyncio.sleep(0.05)

    run(queue, reconcile, body)
    assert num_runs == 3


def test_resync_queues_every_listed_key() -> None:
    keys = ["a", "b"]
    queue = WorkQueue(num_workers=2, resync_s=0.03, list_keys=lambda: keys)
    seen: list[Hashable] = []

    async def reconcile(key: Hashable) -> None:
        seen.append(key)

    async def body() -> None:
        await until(lambda: seen.count("a") >= 2 and seen.count("b") >= 2)

    run(queue, reconcile, body)


def test_urgent_keys_go_first_and_the_rest_waits_for_a_quiet_gap() -> None:
    queue = WorkQueue(num_workers=2, quiet_s=0.05)
    order: list[Hashable] = []

    async def reconcile(key: Hashable) -> None:
        await asyncio.sleep(0.01)
        order.append(key)

    queue.add("later-1")
    queue.add("new-1", urgent=True)
    queue.add("later-2")
    queue.add("later-1", urgent=True)  # promoted: once, among the urgent ones
    queue.add("new-2", urgent=True)

    async def body() -> None:
        await until(lambda: len(order) == 4)

    run(queue, reconcile, body)
    assert sorted(order[:3]) == ["later-1", "new-1", "new-2"] and order[3] == "later-2"


def test_a_normal_key_waits_at_most_max_defer() -> None:
    queue = WorkQueue(num_workers=2, quiet_s=10, max_defer_s=0.3)
    order: list[Hashable] = []

    async def reconcile(key: Hashable) -> None:
        order.append(key)

    async def body() -> None:
        queue.add("u", urgent=True)
        await until(lambda: order == ["u"])
        queue.add("n")
        await asyncio.sleep(0.02)
        assert order == ["u"]  # within the quiet gap
        await until(lambda: order == ["u", "n"], timeout_s=1)

    run(queue, reconcile, body)


def test_at_most_num_workers_run_at_once() -> None:
    queue = WorkQueue(num_workers=3)
    num_running = peak = num_done = 0

    async def reconcile(_: Hashable) -> None:
        nonlocal num_running, peak, num_done
        num_running += 1
        peak = max(peak, num_running)
        await asyncio.sleep(0.01)
        num_running -= 1
        num_done += 1

    for i in range(10):
        queue.add(i)

    async def body() -> None:
        await until(lambda: num_done == 10)

    run(queue, reconcile, body)
    assert peak == 3


def test_delayed_adds_of_a_key_keep_one_timer_the_soonest() -> None:
    """Every reconcile of a loading model asks to look again later: timers must not pile up
    (the first cluster run read a loading pod's /ready dozens of times a second)."""
    queue = WorkQueue(num_workers=1)
    seen: list[Hashable] = []

    async def reconcile(key: Hashable) -> None:
        seen.append(key)

    async def body() -> None:
        for delay in (0.05, 0.03, 0.04, 0.06):
            queue.add_after("k", delay)
        assert len(queue._timers) == 1  # noqa: SLF001
        await until(lambda: seen == ["k"])
        await asyncio.sleep(0.06)
        assert seen == ["k"]

    run(queue, reconcile, body)
