"""Server-Sent Events for the OpenAI routes: chunks as the engine streams, `data: [DONE]` last.

An engine that stops mid-stream, or a request that fails in the engine, ends its stream with
an OpenAI error event and then `[DONE]`, never a cut connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from kubeinfer.runtime.engine.async_engine import EngineDeadError, RequestFailedError
from kubeinfer.runtime.engine.outputs import RequestOutput
from kubeinfer.runtime.server.choices import ChatChoice, CompletionChoice, Job, usage
from kubeinfer.runtime.server.errors import error_body


async def merged(jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the job's place in `jobs`."""
    if len(jobs) == 1:
        async for out in jobs[0].stream:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        try:
            async for out in job.stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, j)) for i, j in enumerate(jobs)]
    try:
        remaining = len(jobs)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def completion_chunks(
    jobs: list[Job], choices: list[CompletionChoice], model: str, rid: str, created: int
) -> AsyncIterator[dict]:
    finals: dict[int, RequestOutput] = {}
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    async for i, out in merged(jobs):
        if out.finished:
            finals[i] = out
        if (choice := choices[i].delta(out)) is not None:
            yield {**head, "choices": [choice]}
    body = choices[0].body
    if body.include_usage:
        outs = [finals[i] for i in sorted(finals)]
        yield {**head, "choices": [], "usage": usage(jobs, outs, choices[0].keeps_output)}


async def chat_chunks(
    jobs: list[Job], choices: list[ChatChoice], model: str, rid: str, created: int
) -> AsyncIterator[dict]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    for choice in choices:
        yield {**head, "choices": [choice.first()]}
    finals: dict[int, RequestOutput] = {}
    async for i, out in merged(jobs):
        if out.finished:
            finals[i] = out
        for delta in choices[i].deltas(out):
            yield {**head, "choices": [delta]}
    if choices[0].body.include_usage:
        yield {**head, "choices": [], "usage": usage(jobs, [finals[i] for i in sorted(finals)])}


def sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except EngineDeadError as e:
            yield f"data: {json.dumps(error_body(503, str(e)))}\n\n"
        except RequestFailedError as e:
            yield f"data: {json.dumps(error_body(500, str(e)))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
