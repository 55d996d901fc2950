"""AsyncEngine: the delivery race, the admission counters, liveness, and failures that must
not stop the engine loop (a callback, a request the engine refuses)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kubeinfer.runtime import SamplingParams
from kubeinfer.runtime.engine.async_engine import (
    AsyncEngine,
    RequestFailedError,
    RequestStream,
    _Stream,
    merge_outputs,
)
from kubeinfer.runtime.engine.config import EngineConfig
from kubeinfer.runtime.engine.engine import Engine
from kubeinfer.runtime.engine.outputs import CompletionOutput, RequestOutput
from kubeinfer.runtime.errors import InvalidRequestError

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> Engine:
    return Engine(tiny_models["llama-gqa"], EngineConfig(num_kv_blocks=64), dtype="float32")


async def consume(stream) -> list[int]:  # noqa: ANN001
    ids: list[int] = []
    async for out in stream:
        ids += out.outputs[0].new_token_ids
    return ids


class AbortingDict(dict):
    """`_streams` whose `get` lets an abort of the same id run right after it, as a thread
    switch to the event loop can: the interleaving that killed the engine loop, made certain."""

    def __init__(self, aengine: AsyncEngine) -> None:
        super().__init__()
        self.aengine = aengine

    def get(self, key, default=None):  # noqa: ANN001, ANN201
        value = super().get(key, default)
        self.aengine.abort(key)
        return value


def test_delivery_survives_an_abort_in_between(engine: Engine) -> None:
    aengine = AsyncEngine(engine)  # not started: `_deliver` runs here, deterministically
    loop = asyncio.new_event_loop()
    try:
        aengine._streams = streams = AbortingDict(aengine)
        streams["r"] = _Stream(loop, asyncio.Queue())
        done = CompletionOutput(0, "", [5], finish_reason="length")
        # before the fix: get, then `del self._streams["r"]` -> KeyError, and the loop died
        aengine._deliver(RequestOutput("r", None, [1], [done], finished=True))
        assert "r" not in streams
    finally:
        loop.close()


def test_queued_counts_and_progress(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    aengine = AsyncEngine(engine)
    assert aengine.seconds_since_progress == 0.0  # no work: nothing to be late with
    gate = threading.Event()
    execute = engine.runner.execute

    def stuck_execute(*args):  # noqa: ANN002, ANN202 - a hung kernel, until the gate opens
        gate.wait(10)
        return execute(*args)

    monkeypatch.setattr(engine.runner, "execute", stuck_execute)

    async def main() -> list[list[int]]:
        prompts = [[1, 2, 3], [4, 5, 6], list(range(10, 20))]
        tasks = [asyncio.create_task(consume(aengine.generate(p, PARAMS))) for p in prompts]
        await asyncio.sleep(0.05)  # each stream has started: submitted, not yet drained
        assert (aengine.num_queued, aengine.num_queued_tokens) == (3, 16)
        aengine.start()
        await asyncio.sleep(0.3)  # drained, scheduled, and the first step hangs at the gate
        assert aengine.num_queued == 0  # scheduled once: no longer queued
        assert aengine.seconds_since_progress >= 0.25
        gate.set()
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
        assert all(len(ids) == 3 for ids in results)
        assert aengine.seconds_since_progress == 0.0
        assert (aengine.num_queued, aengine.num_queued_tokens) == (0, 0)
    finally:
        gate.set()
        aengine.stop()


def test_a_failing_on_finished_callback_does_not_stop_the_engine(engine: Engine) -> None:
    def broken(_: RequestOutput) -> None:
        raise RuntimeError("a bug in a metrics callback")

    aengine = AsyncEngine(engine, on_finished=broken)
    aengine.start()
    try:
        async def run() -> list:
            return await consume(aengine.generate([7, 8], PARAMS))

        first, again = asyncio.run(run()), asyncio.run(run())
        assert len(first) == 3 and first == again and aengine.is_running
    finally:
        aengine.stop()
    deadline = time.monotonic() + 5
    while engine.has_unfinished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_a_request_the_engine_refuses_fails_alone(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    add = engine.add

    def picky_add(request):  # noqa: ANN001, ANN202
        if request.request_id == "refused":
            raise InvalidRequestError("request id 'refused' is already in use")
        return add(request)

    monkeypatch.setattr(engine, "add", picky_add)
    aengine = AsyncEngine(engine)
    aengine.start()

    async def main() -> list[int]:
        with pytest.raises(RequestFailedError, match="InvalidRequestError: request id 'refused'"):
            await consume(aengine.generate([1, 2], PARAMS, request_id="refused"))
        return await consume(aengine.generate([1, 2], PARAMS))

    try:
        assert len(asyncio.run(main())) == 3 and aengine.is_running
    finally:
        aengine.stop()


class _NoEngine:
    """What RequestStream needs of its engine: an abort it must not call here."""

    def abort(self, request_id: str) -> None:
        raise AssertionError(f"aborted {request_id}")


def _step(ids: list[int], new: list[int], finish: str | None = None) -> RequestOutput:
    text = "".join(f"<{i}>" for i in ids)
    c = CompletionOutput(
        0, text, ids, finish_reason=finish, new_text="".join(f"<{i}>" for i in new),
        new_token_ids=new,
    )  # fmt: skip
    return RequestOutput("r", None, [1], [c], finished=finish is not None)


def test_a_lagging_reader_gets_the_queued_outputs_as_one() -> None:
    """Three steps queued before the reader looks: one output with all three steps' tokens and
    text (one SSE chunk for a slow client); a failure queued behind them comes after them."""

    async def main() -> list[Any]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        stream = RequestStream(_NoEngine(), "r", q)  # type: ignore[arg-type]
        for out in (_step([7], [7]), _step([7, 8], [8]), _step([7, 8, 9], [9])):
            q.put_nowait(out)
        first = await stream.__anext__()
        q.put_nowait(_step([7, 8, 9, 4], [4]))
        failed = _step([7, 8, 9, 4], [], finish="error")
        q.put_nowait(failed)
        second = await stream.__anext__()
        with pytest.raises(RequestFailedError):
            await stream.__anext__()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        return [first, second]

    first, second = asyncio.run(main())
    assert first.outputs[0].new_token_ids == [7, 8, 9]
    assert first.outputs[0].new_text == "<7><8><9>"
    assert first.outputs[0].token_ids == [7, 8, 9] and not first.finished
    assert second.outputs[0].new_token_ids == [4] and not second.finished


def test_merged_outputs_keep_the_final_state() -> None:
    done = merge_outputs([_step([7], [7]), _step([7, 8], [8], finish="length")])
    assert done.finished and done.outputs[0].finish_reason == "length"
    assert done.outputs[0].new_token_ids == [7, 8] and done.outputs[0].token_ids == [7, 8]
