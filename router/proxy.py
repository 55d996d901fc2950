"""The proxy: an ASGI app for /v1 that picks a pod per request and streams its answer through.

- The body is read whole, at most `max_request_bytes` (413 beyond, declared or chunked), and
  read for routing by `request_features` only; it is forwarded byte for byte.
- A pod that refuses the connection (connect error or timeout: no byte of the request reached
  it) is marked stale and the request tries another pod, at most `max_connect_retries` more.
- The pod's status, headers and body bytes pass through unchanged (SSE chunks, usage chunks,
  error bodies), plus `x-kubeinfer-pod` naming the pod. When a pod breaks mid-answer, an event
  stream cut between events ends as the runtime ends a failed stream (an OpenAI error event,
  code 502, then `[DONE]`); any other body is cut (the connection closes: the client sees it
  incomplete). Only that pod's answers are affected.
- The client leaving (`http.disconnect`) cancels the exchange: the pod's connection closes,
  and the runtime aborts the request. A request held for a pod leaves the hold queue.
- The router answers itself only 404 (unknown path), 413, and 503 with Retry-After (no pod
  within the hold bounds, or none accepted a connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass

import httpx
from starlette.types import Message, Receive, Scope, Send

from kubeinfer.router.features import CHAT_PATH, COMPLETIONS_PATH, request_features
from kubeinfer.router.metrics import NO_POD
from kubeinfer.router.routing_types import Reject, RequestFeatures
from kubeinfer.router.state import RouterState
from kubeinfer.runtime.server.errors import error_body

logger = logging.getLogger(__name__)

ROUTES = {("POST", COMPLETIONS_PATH), ("POST", CHAT_PATH), ("GET", "/v1/models")}
#: Not forwarded either way (RFC 9110 7.6.1), plus what the HTTP clients set themselves.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)
RESPONSE_DROPPED = HOP_BY_HOP - {b"content-length"} | {b"date", b"server"}
POD_HEADER = b"x-kubeinfer-pod"
SESSION_HEADER = b"x-session-id"
#: A connection the pod never accepted: nothing of the request reached it, so another pod may
#: take it.
CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout)
CLIENT_CLOSED_REQUEST = 499


class _ClientLeftError(Exception):
    """The client disconnected before its body was whole."""


@dataclass(slots=True)
class _Outcome:
    """What one exchange amounted to, for kubeinfer_router_requests_total."""

    pod: str = NO_POD
    code: int = 0


class Proxy:
    def __init__(self, state: RouterState, client: httpx.AsyncClient) -> None:
        self.state, self.client = state, client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome = _Outcome()
        try:
            await self._handle(scope, receive, send, outcome)
        finally:
            self.state.metrics.observe_request(outcome.pod, outcome.code)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, outcome: _Outcome) -> None:
        method, path = scope["method"], scope["path"]
        if (method, path) not in ROUTES:
            outcome.code = 404
            await _send_error(send, 404, f"{method} {path}: not a route of the router")
            return
        headers = [(k.lower(), v) for k, v in scope.get("headers", ())]
        body = b""
        if method == "POST":
            limit = self.state.settings.max_request_bytes
            try:
                read = await _read_body(receive, headers, limit)
            except _ClientLeftError:
                outcome.code = CLIENT_CLOSED_REQUEST
                return
            if read is None:
                outcome.code = 413
                await _send_error(send, 413, f"request body over {limit} bytes")
                return
            body = read
        session = next((v for k, v in headers if k == SESSION_HEADER), b"").decode("latin-1")
        features = request_features(
            path,
            body,
            session_id=session,
            request_id=uuid.uuid4().hex,
            prefix_chars=self.state.settings.prefix_chars,
        )
        forwarded = [(k, v) for k, v in headers if k not in HOP_BY_HOP]
        target = path + (
            f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else ""
        )
        work = asyncio.ensure_future(
            self._exchange(method, target, forwarded, body, features, send, outcome)
        )
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                work.result()
                return
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            outcome.code = CLIENT_CLOSED_REQUEST
        finally:
            work.cancel()
            watcher.cancel()

    async def _exchange(
        self,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        features: RequestFeatures,
        send: Send,
        outcome: _Outcome,
    ) -> None:
        state = self.state
        tried: set[str] = set()
        for attempt in range(state.settings.max_connect_retries + 1):
            decision = await state.route(features, frozenset(tried))
            if isinstance(decision, Reject):
                outcome.pod, outcome.code = NO_POD, 503
                await _send_error(send, 503, decision.why, retry_after=state.settings.retry_after_s)
                return
            pod = state.pods[decision.pod]
            outcome.pod = pod.backend.name
            pod.num_in_flight += 1
            try:
                request = self.client.build_request(
                    method, pod.backend.url + target, headers=headers, content=body
                )
                try:
                    response = await self.client.send(request, stream=True)
                except CONNECT_FAILURES as exc:
                    logger.warning("pod %s refused the connection: %r", pod.backend.name, exc)
                    state.mark_stale(pod.backend.name)
                    tried.add(pod.backend.name)
                    if attempt < state.settings.max_connect_retries:
                        state.metrics.retries.inc()
                    continue
                except httpx.HTTPError as exc:  # accepted, then no answer: not safe to resend
                    logger.warning("pod %s gave no answer: %r", pod.backend.name, exc)
                    outcome.code = 502
                    await _send_error(send, 502, f"pod {pod.backend.name} gave no answer")
                    return
                try:
                    await self._relay(response, send, outcome)
                finally:
                    await response.aclose()
                return
            finally:
                pod.num_in_flight -= 1
        outcome.pod, outcome.code = NO_POD, 503
        await _send_error(
            send,
            503,
            f"no pod accepted the connection ({len(tried)} tried)",
            retry_after=state.settings.retry_after_s,
        )

    async def _relay(self, response: httpx.Response, send: Send, outcome: _Outcome) -> None:
        name = outcome.pod
        outcome.code = response.status_code
        headers = [
            (k.lower(), v) for k, v in response.headers.raw if k.lower() not in RESPONSE_DROPPED
        ]
        headers.append((POD_HEADER, name.encode()))
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": headers}
        )
        at_event_boundary = True
        try:
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                at_event_boundary = chunk.endswith(b"\n\n")
        except httpx.HTTPError as exc:
            logger.warning("pod %s broke a response mid-way: %r", name, exc)
            outcome.code = 502
            self.state.mark_stale(name)
            is_events = response.headers.get("content-type", "").startswith("text/event-stream")
            if not (is_events and at_event_boundary):
                return  # incomplete on purpose: the server closes the connection
            # as the runtime ends a stream that fails: an OpenAI error event, then [DONE]
            event = json.dumps(error_body(502, f"pod {name} failed mid-stream"))
            chunk = f"data: {event}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _read_body(
    receive: Receive, headers: list[tuple[bytes, bytes]], limit: int
) -> bytes | None:
    """The whole body, or None past `limit` bytes (declared or counted; the rest is not read)."""
    declared = next((v for k, v in headers if k == b"content-length"), b"")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] != "http.request":
            raise _ClientLeftError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_error(
    send: Send, status: int, message: str, *, retry_after: int | None = None
) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
