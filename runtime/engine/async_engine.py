"""AsyncEngine: the engine's step loop on a background thread, streams for asyncio callers.

`async for out in engine.generate(prompt, params)` yields a RequestOutput per new token (the
delta in `outputs[0].new_token_ids` / `.new_text`); leaving the loop early (a client that
disconnects) aborts the request and frees its KV blocks. The model runs on the engine thread,
so the event loop never waits on a forward pass: requests and aborts reach the engine through
thread-safe queues, and outputs come back with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kubeinfer.runtime.engine.engine import Engine
from kubeinfer.runtime.engine.outputs import RequestOutput
from kubeinfer.runtime.engine.request import Request
from kubeinfer.runtime.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    def __init__(
        self, engine: Engine, on_finished: Callable[[RequestOutput], None] | None = None
    ) -> None:
        self.engine = engine
        self._on_finished = on_finished
        self._adds: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validate now (ValueError naming the problem), then stream the request's outputs.

        The request enters the engine when the stream is first iterated."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error}")
        request = self.engine.make_request(prompt, params, request_id or uuid.uuid4().hex)
        return self._stream(request)

    async def _stream(self, request: Request) -> AsyncIterator[RequestOutput]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request.request_id] = stream
        self._adds.put(request)
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine stopped: {item}") from item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._aborts.put(request_id)
            self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_queues()
                if not self.engine.has_unfinished:
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out)
        except BaseException as e:  # a bug or a device error: fail every stream, loudly
            logger.exception("engine loop failed")
            self.error = e
            for request_id in list(self._streams):
                self._deliver_error(request_id, e)

    def _drain_queues(self) -> None:
        while True:
            try:
                request = self._adds.get_nowait()
            except queue.Empty:
                break
            if request.request_id in self._streams:  # not aborted before it got here
                self.engine.add(request)
        while True:
            try:
                request_id = self._aborts.get_nowait()
            except queue.Empty:
                break
            out = self.engine.abort(request_id)
            if out is not None and self._on_finished is not None:
                self._on_finished(out)

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished and self._on_finished is not None:
            self._on_finished(out)
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
