"""POST /tokenize and /detokenize, with vLLM's request and response shapes.

- /tokenize takes `{model?, prompt, add_special_tokens = true, return_token_strs = false}`
  or `{model?, messages, add_generation_prompt = true, add_special_tokens = false,
  return_token_strs = false}` (the chat template rendered as for /v1/chat/completions) and
  answers `{count, max_model_len, tokens[, token_strs]}`. A prompt longer than max_model_len
  is tokenized all the same: `count` says so.
- /detokenize takes `{model?, tokens}` and answers `{prompt}`.

The same caps as the completion routes apply (characters of a prompt or a chat, messages), a
detokenized list holds at most max_model_len ids, each in the tokenizer's vocabulary (400
naming the field). Unlike vLLM's, these routes sit behind the same guard as /v1 (API key,
body size, shutdown), since they cost CPU like any other request.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from kubeinfer.runtime.engine.validation import check_token_ids
from kubeinfer.runtime.errors import InvalidRequestError
from kubeinfer.runtime.server.errors import APIError
from kubeinfer.runtime.server.health_routes import get_state
from kubeinfer.runtime.server.limits import check_messages, check_prompt_chars
from kubeinfer.runtime.server.protocol import ChatMessage
from kubeinfer.runtime.server.state import ServerState
from kubeinfer.runtime.tokenizer import ChatTemplateError, Tokenizer

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    """Chat only: end with the assistant's turn opening."""
    add_special_tokens: bool | None = None
    """Default: true for a prompt, false for messages (the template has them), as vLLM's."""
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give a prompt or messages (one of the two)")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: ServerState = Depends(get_state)) -> dict:
    tokenizer, max_model_len = _tokenizer_for(state, body.model)
    limits = state.require_engine()[1]
    if body.messages is not None:
        check_messages(body.messages, limits)
        messages = [m.as_template_message() for m in body.messages]
        special = bool(body.add_special_tokens)
        try:
            ids = await state.run_cpu(
                partial(_encode_chat, tokenizer, messages, body.add_generation_prompt, special)
            )
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None
    else:
        assert body.prompt is not None  # one of the two, by the validator
        check_prompt_chars(body.prompt, limits)
        special = body.add_special_tokens is not False
        ids = await state.run_cpu(partial(tokenizer.encode, body.prompt, special))
    out: dict = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [tokenizer.token_text(t) for t in ids]
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: ServerState = Depends(get_state)) -> dict:
    tokenizer, max_model_len = _tokenizer_for(state, body.model)
    if len(body.tokens) > max_model_len:
        raise APIError(
            400,
            f"tokens: at most {max_model_len} token ids (max_model_len) are allowed, "
            f"got {len(body.tokens)}",
            "tokens",
        )
    try:
        check_token_ids("tokens", body.tokens, tokenizer.vocab_size)
    except InvalidRequestError as e:
        raise APIError(400, str(e), "tokens") from None
    return {"prompt": await state.run_cpu(tokenizer.decode, body.tokens)}


def _tokenizer_for(state: ServerState, model: str | None) -> tuple[Tokenizer, int]:
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {state.model_name!r}",
            "model",
            "model_not_found",
        )
    engine, _ = state.require_engine()
    tokenizer = engine.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer", "model")
    return tokenizer, engine.engine.max_model_len


def _encode_chat(
    tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool, special: bool
) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=special)
