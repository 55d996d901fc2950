"""Server-Sent Events for the OpenAI routes: chunks as the engine streams, `data: [DONE]` last.

An engine that stops mid-stream, or a request that fails in the engine, ends its stream with
an OpenAI error event and then `[DONE]`, never a cut connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from kubeinfer.runtime.engine.async_engine import EngineDeadError, RequestFailedError
from kubeinfer.runtime.engine.outputs import RequestOutput
from kubeinfer.runtime.server.errors import error_body
from kubeinfer.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from kubeinfer.runtime.server.tool_calls import ToolCallStream, tool_finish_reason


@dataclass(slots=True)
class Job:
    """One prompt of a request, validated and ready to stream."""

    prompt_ids: list[int]
    stream: AsyncIterator[RequestOutput]


def usage(outs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def merged(jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the prompt's index."""
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
    jobs: list[Job], body: CompletionRequest, model: str, rid: str, created: int
) -> AsyncIterator[dict]:
    finals: dict[int, RequestOutput] = {}
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    async for i, out in merged(jobs):
        c = out.outputs[0]
        if out.finished:
            finals[i] = out
        if c.new_text or out.finished:
            yield {
                **head,
                "choices": [
                    {
                        "index": i,
                        "text": c.new_text,
                        "logprobs": None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                ],
            }
    if body.include_usage:
        yield {**head, "choices": [], "usage": usage([finals[i] for i in sorted(finals)])}


async def chat_chunks(
    job: Job, body: ChatCompletionRequest, model: str, rid: str, created: int
) -> AsyncIterator[dict]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    yield {
        **head,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    final = None
    tools = ToolCallStream(body)  # holds back text that may be a tool call
    async for _, out in merged([job]):
        c = out.outputs[0]
        text, finish_reason = tools.push(c.new_text), c.finish_reason
        if out.finished:
            rest, calls = tools.finish()
            text += rest
            if calls:  # each call whole, in one delta, before the finish chunk
                deltas = [call.as_openai(i) for i, call in enumerate(calls)]
                finish_reason = tool_finish_reason(finish_reason, calls, body)
                if text:
                    yield _chat_chunk(head, {"content": text}, None, None)
                    text = ""
                yield _chat_chunk(head, {"tool_calls": deltas}, None, None)
        if text or out.finished:
            delta = {"content": text} if text else {}
            yield _chat_chunk(head, delta, finish_reason, c.stop_reason)
        final = out
    if body.include_usage and final is not None:
        yield {**head, "choices": [], "usage": usage([final])}


def _chat_chunk(
    head: dict, delta: dict, finish_reason: str | None, stop_reason: int | str | None
) -> dict:
    choice = {
        "index": 0,
        "delta": delta,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    return {**head, "choices": [choice]}


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
