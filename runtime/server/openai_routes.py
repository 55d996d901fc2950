"""The OpenAI routes: /v1/models, /v1/completions, /v1/chat/completions (streaming or not).

Each request is validated in full before anything streams (a bad request is a 400, never a
broken stream); streams are Server-Sent Events ending in `data: [DONE]`. A client that goes
away mid-stream cancels its generator, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, StreamingResponse

from kubeinfer.runtime.engine.async_engine import AsyncEngine, EngineDeadError
from kubeinfer.runtime.engine.outputs import RequestOutput
from kubeinfer.runtime.server.errors import APIError, error_body
from kubeinfer.runtime.server.health_routes import get_state
from kubeinfer.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from kubeinfer.runtime.server.state import ServerState
from kubeinfer.runtime.tokenizer import ChatTemplateError

router = APIRouter()
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for legacy completions


@dataclass(slots=True)
class _Job:
    """One prompt of a request, validated and ready to stream."""

    prompt_ids: list[int]
    stream: AsyncIterator[RequestOutput]


@router.get("/v1/models")
async def list_models(state: ServerState = Depends(get_state)) -> dict:
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model_id}")
async def get_model(model_id: str, state: ServerState = Depends(get_state)) -> dict:
    if model_id != state.model_name:
        raise APIError(404, f"model {model_id!r} does not exist", "model", "model_not_found")
    return _model_card(state)


@router.post("/v1/completions", response_model=None)
async def create_completion(
    body: CompletionRequest, state: ServerState = Depends(get_state)
) -> JSONResponse | StreamingResponse:
    engine = _engine_for(state, body)
    tokenizer = engine.engine.tokenizer
    jobs = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            if tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids", "prompt")
            prompt = tokenizer.encode(prompt)
        jobs.append(
            _job(engine, state, body, prompt, body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS)
        )
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return _sse(_completion_chunks(jobs, body, state.model_name, rid, created))
    outs = await _collect(jobs)
    choices = [
        {
            "index": i,
            "text": o.outputs[0].text,
            "logprobs": None,
            "finish_reason": o.outputs[0].finish_reason,
            "stop_reason": o.outputs[0].stop_reason,
        }
        for i, o in enumerate(outs)
    ]
    return JSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": choices,
            "usage": _usage(outs),
        }
    )


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, state: ServerState = Depends(get_state)
) -> JSONResponse | StreamingResponse:
    engine = _engine_for(state, body)
    tokenizer = engine.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so no chat template", "messages")
    try:
        prompt_ids = tokenizer.encode_chat(
            [m.as_template_message() for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
        )
    except ChatTemplateError as e:
        raise APIError(400, str(e), "messages") from None
    max_tokens = body.requested_max_tokens or max(engine.engine.max_model_len - len(prompt_ids), 1)
    job = _job(engine, state, body, prompt_ids, max_tokens)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return _sse(_chat_chunks(job, body, state.model_name, rid, created))
    (out,) = await _collect([job])
    completion = out.outputs[0]
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": completion.text},
        "logprobs": None,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": state.model_name,
            "choices": [choice],
            "usage": _usage([out]),
        }
    )


# helpers


def _model_card(state: ServerState) -> dict:
    card: dict[str, object] = {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "kubeinfer",
    }
    if state.engine is not None:
        card["max_model_len"] = state.engine.engine.max_model_len
    return card


def _engine_for(state: ServerState, body: _Sampling) -> AsyncEngine:
    if body.model is not None and body.model != state.model_name:
        raise APIError(
            404,
            f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
            "model",
            "model_not_found",
        )
    return state.require_engine()


def _job(
    engine: AsyncEngine, state: ServerState, body: _Sampling, prompt_ids: list[int], max_tokens: int
) -> _Job:
    limit = engine.engine.max_model_len
    if len(prompt_ids) + max_tokens > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
            f"{max_tokens} in the completion). Reduce the prompt or max_tokens.",
            "max_tokens",
        )
    params = body.sampling_params(max_tokens)
    return _Job(prompt_ids, engine.generate(prompt_ids, params))


async def _collect(jobs: list[_Job]) -> list[RequestOutput]:
    async def last(job: _Job) -> RequestOutput:
        final = None
        async for out in job.stream:
            final = out
        assert final is not None
        return final

    try:
        return list(await asyncio.gather(*(last(j) for j in jobs)))
    except EngineDeadError as e:
        raise APIError(503, str(e)) from None


def _usage(outs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _merged(jobs: list[_Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the prompt's index."""
    if len(jobs) == 1:
        async for out in jobs[0].stream:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, job: _Job) -> None:
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


async def _completion_chunks(
    jobs: list[_Job], body: CompletionRequest, model: str, rid: str, created: int
) -> AsyncIterator[dict]:
    finals: dict[int, RequestOutput] = {}
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    async for i, out in _merged(jobs):
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
        yield {**head, "choices": [], "usage": _usage([finals[i] for i in sorted(finals)])}


async def _chat_chunks(
    job: _Job, body: ChatCompletionRequest, model: str, rid: str, created: int
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
    async for _, out in _merged([job]):
        c = out.outputs[0]
        if c.new_text or out.finished:
            delta = {"content": c.new_text} if c.new_text else {}
            yield {
                **head,
                "choices": [
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                ],
            }
        final = out
    if body.include_usage and final is not None:
        yield {**head, "choices": [], "usage": _usage([final])}


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except EngineDeadError as e:
            yield f"data: {json.dumps(error_body(503, str(e)))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
