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
from kubeinfer.runtime.engine.request import Request as EngineRequest
from kubeinfer.runtime.server.choices import ChatChoice, CompletionChoice, Job, usage
from kubeinfer.runtime.server.disconnect import until_disconnect
from kubeinfer.runtime.server.errors import APIError
from kubeinfer.runtime.server.health_routes import get_state
from kubeinfer.runtime.server.limits import RequestLimits, check_chat, check_completion
from kubeinfer.runtime.server.logprobs import TokenTexts
from kubeinfer.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _Sampling,
)
from kubeinfer.runtime.server.sse import chat_chunks, completion_chunks, sse
from kubeinfer.runtime.server.state import ServerState
from kubeinfer.runtime.server.tool_calls import (
    auto_tool_spec,
    template_inputs,
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
    with state.admission.preparing(state.engine_queue(), len(prompts) * body.n, limits):
        prompt_ids = await state.run_cpu(_encode_all, tokenizer, prompts)
        # max_tokens 0 (echo only): generate one token and drop it, as vLLM does
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        await _compile_guided(engine, state, body.guided_spec())
        vocab = engine.engine.runner.vocab_size
        texts = await state.run_cpu(_echo_texts, tokenizer, prompts, prompt_ids, body.echo, vocab)
        # no await from the token-queue check to the submit: concurrent requests would all
        # pass the check against the same queue before any of them joined it
        groups = _requests(engine, state, limits, body, prompt_ids, max(max_tokens, 1))
        jobs = _submit(engine, groups, body.n, texts)
    token_texts = TokenTexts(tokenizer)
    choices = [CompletionChoice(job, body, token_texts) for job in jobs]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return sse(completion_chunks(jobs, choices, state.model_name, rid, created))
    outs = await _collect(jobs)
    return JSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": [choice.whole(out) for choice, out in zip(choices, outs, strict=True)],
            "usage": usage(jobs, outs, body.max_tokens != 0),
        }
    )


async def _chat_completion(body: ChatCompletionRequest, state: ServerState) -> Response:
    engine, limits = _engine_for(state, body)
    check_chat(body, limits)
    tokenizer = engine.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so no chat template", "messages")
    messages, extra = template_inputs(body, tokenizer.chat_template)
    with state.admission.preparing(state.engine_queue(), body.n, limits):
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
        groups = _requests(engine, state, limits, body, [prompt_ids], max_tokens, guided)
        jobs = _submit(engine, groups, body.n)
    token_texts = TokenTexts(tokenizer)
    choices = [ChatChoice(job, body, token_texts) for job in jobs]
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return sse(chat_chunks(jobs, choices, state.model_name, rid, created))
    outs = await _collect(jobs)
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": state.model_name,
            "choices": [choice.whole(out) for choice, out in zip(choices, outs, strict=True)],
            "usage": usage(jobs, outs),
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


async def _compile_guided(engine: AsyncEngine, state: ServerState, spec: GuidedSpec | None) -> None:
    """Compile a structured output's grammar on the CPU pool (a 400 naming the field if it
    does not compile); `make_request` then finds it in the compiler's cache."""
    if spec is not None:
        await state.run_cpu(engine.engine.grammars.compile, spec)


def _echo_texts(
    tokenizer: Tokenizer | None,
    prompts: list[str | list[int]],
    prompt_ids: list[list[int]],
    echo: bool,
    vocab_size: int,
) -> list[str]:
    """Each prompt's text for echo: as sent, or its token ids decoded (runs on the CPU pool).
    Ids outside the vocabulary are not decoded (tokenizers raises past 2**32): the engine's
    check refuses that prompt with a 400 right after."""
    if not echo:
        return [""] * len(prompts)
    return [
        p
        if isinstance(p, str)
        else tokenizer.decode(ids, skip_special_tokens=False)
        if tokenizer is not None and all(0 <= i < vocab_size for i in ids)
        else ""
        for p, ids in zip(prompts, prompt_ids, strict=True)
    ]


def _encode_all(tokenizer: Tokenizer | None, prompts: list[str | list[int]]) -> list[list[int]]:
    """Token ids of every prompt (runs on the CPU pool)."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            assert tokenizer is not None  # checked by the route
            p = tokenizer.encode(p)
        out.append(p)
    return out


def _requests(
    engine: AsyncEngine,
    state: ServerState,
    limits: RequestLimits,
    body: _Sampling,
    prompt_ids: list[list[int]],
    max_tokens: int,
    guided: GuidedSpec | None = None,
) -> list[list[EngineRequest]]:
    """Check every prompt against the model and the token queue; each prompt's n engine
    requests. Nothing is queued yet: all of a request's sequences are accepted, or none."""
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
        state.engine_queue(), sum(len(ids) for ids in prompt_ids) * body.n, limits
    )
    params = body.sampling_params(max_tokens)
    if guided is not None:  # the body's own, or one the route adds (tool_choice auto)
        params = dataclasses.replace(params, guided=guided)
    return [
        engine.engine.make_requests(ids, params, uuid.uuid4().hex, body.cache_salt)
        for ids in prompt_ids
    ]


def _submit(
    engine: AsyncEngine, groups: list[list[EngineRequest]], n: int, texts: list[str] | None = None
) -> list[Job]:
    """Queue every request; a Job each, with its choice index (prompt index x n + i)."""
    texts = texts or [""] * len(groups)
    return [
        Job(r.prompt_token_ids, engine.submit(r), p * n + r.index, p, texts[p])
        for p, group in enumerate(groups)
        for r in group
    ]


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
