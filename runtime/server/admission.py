"""Admission control: a bounded waiting queue, in requests and in prompt tokens.

A request waits from the moment the server accepts it until the engine first schedules it:
first here, while its prompt is tokenized (`num_preparing`), then in the engine's queue
(`AsyncEngine.num_queued`, `num_queued_tokens`). Past either bound the request is refused
with 429 and `Retry-After`, before any work is done for it (the request bound is checked on
arrival, the token bound once its prompt is tokenized), and counted in
`kubeinfer:requests_rejected_total{reason}`. A request is always admitted into an empty token
queue, so one long prompt that fits `max_model_len` is never refused for its size alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from kubeinfer.runtime.server.errors import APIError
from kubeinfer.runtime.server.limits import RequestLimits

RejectReason = Literal["queue_requests", "queue_tokens"]
RETRY_AFTER_S = 1
RATE_LIMIT_CODE = "rate_limit_exceeded"


@dataclass(frozen=True, slots=True)
class QueueView:
    num_requests: int
    num_tokens: int


def refusal(
    queue: QueueView, num_new_requests: int, num_new_tokens: int, limits: RequestLimits
) -> tuple[RejectReason, str] | None:
    """Why these new requests may not join the queue, or None when they may (pure)."""
    if queue.num_requests + num_new_requests > limits.max_queued_requests:
        return "queue_requests", (
            f"the server is overloaded: {queue.num_requests} requests are waiting "
            f"(at most {limits.max_queued_requests}); retry later"
        )
    if queue.num_tokens and queue.num_tokens + num_new_tokens > limits.max_queued_tokens:
        return "queue_tokens", (
            f"the server is overloaded: {queue.num_tokens} prompt tokens are waiting "
            f"(at most {limits.max_queued_tokens}); retry later"
        )
    return None


class Admission:
    """The server's side of the queue: requests being prepared, and the 429 decisions."""

    def __init__(self, on_reject: Callable[[RejectReason], None] | None = None) -> None:
        self.num_preparing = 0
        self._on_reject = on_reject

    @contextmanager
    def preparing(
        self, engine_queue: QueueView, num_requests: int, limits: RequestLimits
    ) -> Iterator[None]:
        """Hold `num_requests` places while they are tokenized; 429 when the queue is full."""
        queue = QueueView(engine_queue.num_requests + self.num_preparing, engine_queue.num_tokens)
        self._check(queue, num_requests, 0, limits)
        self.num_preparing += num_requests
        try:
            yield
        finally:
            self.num_preparing -= num_requests

    def full(self, engine_queue: QueueView, limits: RequestLimits) -> str | None:
        """The 429 message when not even one more request may wait (counted), else None."""
        queue = QueueView(engine_queue.num_requests + self.num_preparing, engine_queue.num_tokens)
        refused = refusal(queue, 1, 0, limits)
        if refused is None:
            return None
        if self._on_reject is not None:
            self._on_reject(refused[0])
        return refused[1]

    def check_tokens(self, engine_queue: QueueView, num_tokens: int, limits: RequestLimits) -> None:
        """429 when these prompt tokens would overflow the engine's token queue."""
        self._check(QueueView(0, engine_queue.num_tokens), 0, num_tokens, limits)

    def _check(
        self, queue: QueueView, num_requests: int, num_tokens: int, limits: RequestLimits
    ) -> None:
        refused = refusal(queue, num_requests, num_tokens, limits)
        if refused is None:
            return
        reason, message = refused
        if self._on_reject is not None:
            self._on_reject(reason)
        raise APIError(
            429, message, None, RATE_LIMIT_CODE, headers={"Retry-After": str(RETRY_AFTER_S)}
        )
