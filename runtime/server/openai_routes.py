"""The OpenAI routes: /v1/models, /v1/completions, /v1/chat/completions (streaming or not).

Each request goes through the same gates before the engine sees it: the body's sizes against
the server's caps (limits.py, 400 naming the field), a place in the bounded queue (admission.py,
429), its prompt tokenized or its chat template rendered on the CPU pool (never on the event
loop), then the token ids and sampling fields against the model (400 naming the field). A bad
request is a 400 before anything streams, never a broken stream; streams are Server-Sent Events
ending in `data: [DONE]` (sse.py). A client that goes away aborts its request in the engine,
streamed or not, running or still queued.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from functools import partial

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from kubeinfer.runtime.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from kubeinfer.runtime.engine.guided_spec import GuidedSpec
from kubeinfer.runtime.engine.outputs import RequestOutput
from kubeinfer.runtime.server.disconnect import until_disconnect
from kubeinfer.runtime.server.errors import APIError
from kubeinfer.runtime.server.health_routes import get_state
from kubeinfer.runtime.server.limits import RequestLimits, check_chat, check_completion
from kubeinfer.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from kubeinfer.runtime.server.sse import Job, chat_chunks, completion_chunks, sse, usage
from kubeinfer.runtime.server.state import ServerState
from kubeinfer.runtime.server.tool_calls import (
    auto_tool_spec,
    parse_output,
    template_inputs,
    tool_finish_reason,
)
from kubeinfer.runtime.tokenizer import ChatTemplateError, Tokenizer

router = APIRouter()
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for legacy completions


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
    body: CompletionRequest, request: Request, state: ServerState = Depends(get_state)
) -> Response:
    return await until_disconnect(request, _completion(body, state))


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, state: ServerState = Depends(get_state)
) -> Response:
    return await until_disconnect(request, _chat_completion(body, state))


async def _completion(body: CompletionRequest, state: ServerState) -> Response:
    engine, limits = _engine_for(state, body)
    check_completion(body, limits)
    prompts = body.prompts()
    tokenizer = engine.engine.tokenizer
    if tokenizer is None and any(isinstance(p, str) for p in prompts):
        raise APIError(400, "this model has no tokenizer: send token ids", "prompt")
    with state.admission.preparing(state.engine_queue(), len(prompts), limits):
        prompt_ids = await state.run_cpu(_encode_all, tokenizer, prompts)
        await _compile_guided(engine, state, body.guided_spec())
        max_tokens = body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        jobs = _jobs(engine, state, limits, body, prompt_ids, max_tokens)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return sse(completion_chunks(jobs, body, state.model_name, rid, created))
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
            "usage": usage(outs),
        }
    )


async def _chat_completion(body: ChatCompletionRequest, state: ServerState) -> Response:
    engine, limits = _engine_for(state, body)
    check_chat(body, limits)
    tokenizer = engine.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so no chat template", "messages")
    messages, extra = template_inputs(body, tokenizer.chat_template)
    with state.admission.preparing(state.engine_queue(), 1, limits):
        try:
            prompt_ids = await state.run_cpu(
                partial(
                    tokenizer.encode_chat,
                    messages,
                    add_generation_prompt=body.add_generation_prompt,
                    **extra,
                )
            )
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None
        guided = body.guided_spec() or auto_tool_spec(body, tokenizer.chat_template)
        await _compile_guided(engine, state, guided)
        max_model_len = engine.engine.max_model_len
        max_tokens = body.requested_max_tokens or max(max_model_len - len(prompt_ids), 1)
        (job,) = _jobs(engine, state, limits, body, [prompt_ids], max_tokens, guided)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return sse(chat_chunks(job, body, state.model_name, rid, created))
    (out,) = await _collect([job])
    completion = out.outputs[0]
    content, calls = parse_output(completion.text, body)
    message: dict[str, object] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.as_openai() for c in calls]
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": tool_finish_reason(completion.finish_reason, calls, body),
        "stop_reason": completion.stop_reason,
    }
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": state.model_name,
            "choices": [choice],
            "usage": usage([out]),
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


def _engine_for(state: ServerState, body: _Sampling) -> tuple[AsyncEngine, RequestLimits]:
    if body.model is not None and body.model != state.model_name:
        raise APIError(
            404,
            f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
            "model",
            "model_not_found",
        )
    return state.require_engine()


async def _compile_guided(
    engine: AsyncEngine, state: ServerState, spec: GuidedSpec | None
) -> None:
    """Compile a structured output's grammar on the CPU pool (a 400 naming the field if it
    does not compile); `make_request` then finds it in the compiler's cache."""
    if spec is not None:
        await state.run_cpu(engine.engine.grammars.compile, spec)


def _encode_all(tokenizer: Tokenizer | None, prompts: list[str | list[int]]) -> list[list[int]]:
    """Token ids of every prompt (runs on the CPU pool)."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            assert tokenizer is not None  # checked by the route
            p = tokenizer.encode(p)
        out.append(p)
    return out


def _jobs(
    engine: AsyncEngine,
    state: ServerState,
    limits: RequestLimits,
    body: _Sampling,
    prompt_ids: list[list[int]],
    max_tokens: int,
    guided: GuidedSpec | None = None,
) -> list[Job]:
    """Check every prompt against the model and the token queue, then hand them to the engine:
    all of a request's prompts are accepted, or none."""
    limit = engine.engine.max_model_len
    for ids in prompt_ids:
        if len(ids) + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} in the completion). Reduce the prompt or max_tokens.",
                "max_tokens",
            )
    state.admission.check_tokens(
        state.engine_queue(), sum(len(ids) for ids in prompt_ids), limits
    )
    params = body.sampling_params(max_tokens)
    if guided is not None:  # the body's own, or one the route adds (tool_choice auto)
        params = dataclasses.replace(params, guided=guided)
    requests = [
        engine.engine.make_request(ids, params, uuid.uuid4().hex, body.cache_salt)
        for ids in prompt_ids
    ]
    return [Job(r.prompt_token_ids, engine.submit(r)) for r in requests]


async def _collect(jobs: list[Job]) -> list[RequestOutput]:
    async def last(job: Job) -> RequestOutput:
        final = None
        async for out in job.stream:
            final = out
        assert final is not None
        return final

    tasks = [asyncio.ensure_future(last(j)) for j in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except EngineDeadError as e:
        raise APIError(503, str(e)) from None
    except RequestFailedError as e:
        raise APIError(500, str(e)) from None
    finally:  # one prompt failed: abort its siblings instead of leaving them to run unread
        for task in tasks:
            task.cancel()
