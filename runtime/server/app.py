"""create_app(settings): the FastAPI app — routes, error handlers, auth and body-size guard.

The model loads in the lifespan hook on a background thread (see state.py); the ASGI guard in
front of the routes answers 401 (API key), 413 (body too large) and 503 (shutting down) before
any route runs.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kubeinfer import __version__
from kubeinfer.runtime.server.admission import RATE_LIMIT_CODE, RETRY_AFTER_S
from kubeinfer.runtime.server.errors import error_body, install_error_handlers
from kubeinfer.runtime.server.health_routes import router as health_router
from kubeinfer.runtime.server.openai_routes import router as openai_router
from kubeinfer.runtime.server.settings import ServerSettings
from kubeinfer.runtime.server.state import ServerState
from kubeinfer.runtime.server.tokenize_routes import router as tokenize_router

GUARDED = ("/v1", "/tokenize", "/detokenize")
"""Paths behind the guard: the API, and the tokenizer routes (they cost CPU as requests do)."""


class Guard:
    """Pure ASGI middleware in front of /v1 and the tokenizer routes: API key (401), shutdown
    (503), body size (413).

    A POST that arrives while the waiting queue is already full gets its 429 here, before its
    body is read (the route makes the exact check, with the request's own size). The body is
    read here, whole and bounded, before any route runs: a body over the limit gets 413 whether
    it declared a Content-Length or came chunked, and the route sees it replayed. Messages after
    the body (the client's disconnect) pass straight through, so routes and streams still see a
    client leave. Every /v1 request is counted in flight until its last byte is sent, which is
    what the SIGTERM drain waits for.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state
        key = state.settings.api_key
        self.api_key = key.get_secret_value().encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        if self.api_key is not None:
            auth = headers.get(b"authorization", b"")
            token = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.api_key):
                await _send_error(
                    send, 401, "missing or invalid API key", [(b"www-authenticate", b"Bearer")]
                )
                return
        if self.state.refusing:
            await _send_error(send, 503, "server is shutting down")
            return
        if scope["method"] == "POST" and (full := self.state.queue_full()) is not None:
            # refused before its body is read: under a flood, a 429 costs the loop little
            await _send_error(send, 429, full, [(b"retry-after", str(RETRY_AFTER_S).encode())])
            return
        limit = self.state.max_request_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_error(send, 413, f"request body over {limit} bytes")
            return
        body = await _read_body(receive, limit)
        if body is None:
            await _send_error(send, 413, f"request body over {limit} bytes")
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        self.state.num_in_flight += 1
        try:
            await self.app(scope, replay, send)
        finally:
            self.state.num_in_flight -= 1


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None once it passes `limit` bytes (the rest is not read)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left before sending it all
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_error(
    send: Send, status: int, message: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    code = RATE_LIMIT_CODE if status == 429 else None
    body = json.dumps(error_body(status, message, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": body})


def create_probe_app(state: ServerState) -> FastAPI:
    """/health, /ready, /metrics and /version alone, over the same state (`--probe-port`)."""
    app = FastAPI(title="kubeinfer probes", version=__version__, openapi_url=None)
    app.state.server = state
    app.include_router(health_router)
    return app


def create_app(settings: ServerSettings, state: ServerState | None = None) -> FastAPI:
    state = state or ServerState(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if state.engine is None and state.load_error is None:
            state.load_in_background()
        yield
        state.close()

    app = FastAPI(title="kubeinfer", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(tokenize_router)
    app.include_router(health_router)
    app.add_middleware(Guard, state=state)
    return app
