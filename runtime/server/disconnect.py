"""Abort a request's work when its client goes away, streamed or not, queued or running.

A non-streamed request has no response bytes to fail on while it waits, so uvicorn would let
it run (and hold its place in the engine's queue) after its client left. `until_disconnect`
runs the route's work beside a watcher on the ASGI receive channel; when the client's
`http.disconnect` arrives first, the work is cancelled, which closes the engine streams and
aborts their requests. Streams get the same from Starlette's StreamingResponse.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

T = TypeVar("T")
#: Not sent to anyone: the client is gone. Logged by access logs as nginx does.
CLIENT_CLOSED_REQUEST = 499


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | Response:
    """`await work`, unless the client disconnects first: then cancel it and answer 499."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        watcher.cancel()
        task.cancel()
