"""AsyncEngine: the engine's step loop on a background thread, streams for asyncio callers.

`async for out in engine.generate(prompt, params)` yields a RequestOutput per new token (the
delta in `outputs[0].new_token_ids` / `.new_text`); the request is queued when `generate`
returns, and leaving its stream early (a client that disconnects, queued or running) aborts it
and frees its KV blocks. The model runs on the engine thread,
so the event loop never waits on a forward pass: requests and aborts reach the engine through
thread-safe queues, and outputs come back with `call_soon_threadsafe`.

A request the engine fails alone (finish_reason "error") ends its stream with
`RequestFailedError`; the engine and every other stream go on. `EngineDeadError` means the
engine loop itself stopped. For the server's admission control and liveness, `num_queued`,
`num_queued_tokens` and `seconds_since_progress` are plain reads, safe from any thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from kubeinfer.runtime.engine.engine import Engine
from kubeinfer.runtime.engine.isolation import failure_message
from kubeinfer.runtime.engine.outputs import CompletionOutput, RequestOutput
from kubeinfer.runtime.engine.request import Request
from kubeinfer.runtime.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone (its message is `RequestOutput.error`); the engine
    goes on. The server answers 500, or ends a stream with an error event."""

    def __init__(self, output: RequestOutput) -> None:
        super().__init__(output.error or "request failed in the engine")
        self.output = output


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
        # each counter has one writer thread, so no read-modify-write ever races
        self._num_submitted = self._num_submitted_tokens = 0  # event loop thread
        self._num_drained = self._num_drained_tokens = 0  # engine thread
        self._last_progress = time.monotonic()  # engine thread: its last sign of life

    def start(self) -> None:
        self._last_progress = time.monotonic()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.close()  # tensor-parallel workers, if any

    @property
    def failure(self) -> BaseException | None:
        """Why the engine can serve no more: the loop's error, or a fault found outside a step
        (a tensor-parallel rank that exited, seen before the loop raises it); None while up."""
        return self.error if self.error is not None else self.engine.fault

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        """Requests submitted and never scheduled yet: not yet handed to the engine thread, or
        in the scheduler's queue without having run. A preempted request, having run, is not
        counted. O(1); may be off by one for an instant while a request is handed over."""
        drained = self._num_drained  # read before submitted, so that the difference is >= 0
        return self._num_submitted - drained + self.engine.scheduler.num_queued

    @property
    def num_queued_tokens(self) -> int:
        """The prompt tokens of the `num_queued` requests."""
        drained = self._num_drained_tokens
        return self._num_submitted_tokens - drained + self.engine.scheduler.num_queued_tokens

    @property
    def seconds_since_progress(self) -> float:
        """0.0 when there is no pending work; else seconds since the engine thread last
        finished a step or looked for work (it looks at least every 0.5 s while idle). Large
        while work is pending: the loop is stuck (a hung kernel, a deadlock)."""
        drained = self._num_drained
        if self._num_submitted == drained and not self.engine.has_unfinished:
            return 0.0
        return max(time.monotonic() - self._last_progress, 0.0)

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Validate now (InvalidRequestError, a ValueError naming the field), queue the request
        and return its stream; RequestFailedError if the engine fails it. Requests share cached
        prefixes only with equal `cache_salt`s. Call it from the event loop that reads the
        stream."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error}")
        request = self.engine.make_request(
            prompt, params, request_id or uuid.uuid4().hex, cache_salt
        )
        return self.submit(request)

    def submit(self, request: Request) -> RequestStream:
        """Queue a request made by `engine.make_request` now, so that it counts in `num_queued`
        at once (admission control reads it before the stream is first read)."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request.request_id] = stream
        self._num_submitted_tokens += len(request.prompt_token_ids)
        self._num_submitted += 1
        self._adds.put(request)
        self._wake.set()
        return RequestStream(self, request.request_id, stream.queue)

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._aborts.put(request_id)
            self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if (fault := self.engine.fault) is not None:  # e.g. a tensor-parallel rank
                    raise fault
                self._drain_queues()
                self._last_progress = time.monotonic()
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
            self._num_drained_tokens += len(request.prompt_token_ids)
            self._num_drained += 1
            if request.request_id not in self._streams:  # aborted before it got here
                continue
            try:
                self.engine.add(request)
            except Exception as e:  # noqa: BLE001 - e.g. a request id already in use
                self._deliver(_failed_output(request, e))
        while True:
            try:
                request_id = self._aborts.get_nowait()
            except queue.Empty:
                break
            out = self.engine.abort(request_id)
            if out is not None:
                self._notify_finished(out)

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished:
            self._notify_finished(out)
            # pop, not get-then-del: abort() may pop the same id on the event loop meanwhile
            stream = self._streams.pop(out.request_id, None)
        else:
            stream = self._streams.get(out.request_id)
        if stream is not None:
            self._send(out.request_id, stream, out)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._send(request_id, stream, error)

    def _notify_finished(self, out: RequestOutput) -> None:
        if self._on_finished is None:
            return
        try:
            self._on_finished(out)
        except Exception:  # a metrics callback must not stop the engine
            logger.exception("on_finished callback failed for request %s", out.request_id)

    def _send(self, request_id: str, stream: _Stream, item: RequestOutput | BaseException) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is listening any more
            logger.warning("request %s: its event loop is closed; aborting it", request_id)
            self.abort(request_id)


class RequestStream:
    """One request's outputs for `async for`. Leaving before the last output (a `break`, an
    exception, a cancelled reader, or dropping the stream unread) aborts the request, so a
    client that goes away never leaves work behind, queued or running.

    A reader that falls behind gets the outputs queued meanwhile as one (`merge_outputs`, as
    vLLM's output collector does): a slow client costs one SSE chunk per read, not one per
    token, and the event loop catches up instead of writing a backlog chunk by chunk."""

    __slots__ = ("_engine", "_queue", "_done", "_next", "request_id")

    def __init__(
        self, engine: AsyncEngine, request_id: str, q: asyncio.Queue[RequestOutput | BaseException]
    ) -> None:
        self._engine, self.request_id, self._queue, self._done = engine, request_id, q, False
        self._next: RequestOutput | BaseException | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item, self._next = self._next, None
        if item is None:
            try:
                item = await self._queue.get()
            except BaseException:  # cancelled while waiting: its reader is gone
                self.close()
                raise
        if isinstance(item, BaseException):
            self._done = True
            raise EngineDeadError(f"engine stopped: {item}") from item
        backlog = [item]
        while not backlog[-1].finished and not self._queue.empty():
            later = self._queue.get_nowait()
            if isinstance(later, BaseException) or _failed(later):
                self._next = later  # what came before it is delivered first
                break
            backlog.append(later)
        item = merge_outputs(backlog) if len(backlog) > 1 else item
        if item.finished:
            self._done = True
            if _failed(item):
                raise RequestFailedError(item)
        return item

    def close(self) -> None:
        """Abort the request unless it has finished (idempotent)."""
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def _failed(out: RequestOutput) -> bool:
    return out.finished and out.outputs[0].finish_reason == "error"


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """One output for consecutive ones of a request: the last one's state (cumulative text and
    tokens, finish, metrics) with every step's new text, tokens and logprobs, joined once."""
    steps = [out.outputs[0] for out in outputs]
    merged = replace(
        steps[-1],
        new_text="".join(c.new_text for c in steps),
        new_token_ids=[t for c in steps for t in c.new_token_ids],
        new_logprobs=[lp for c in steps for lp in c.new_logprobs],
    )
    return replace(outputs[-1], outputs=[merged])


def _failed_output(request: Request, error: Exception) -> RequestOutput:
    """The final output of a request that could not even enter the engine."""
    completion = CompletionOutput(0, "", [], finish_reason="error")
    return RequestOutput(
        request.request_id,
        request.prompt,
        request.prompt_token_ids,
        [completion],
        finished=True,
        error=failure_message(error),
    )
