"""RequestLimits: every size a client controls, capped, and the checks that name what was wrong.

The caps come from the server settings; those left unset follow from `max_model_len` (a body
can never cost more tokenizer CPU than the context it could fill justifies) and from the
engine's batch settings (the waiting queue). `check_*` raise `APIError(400)` naming the field,
the cap and the value sent; they run on the parsed body before anything is tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubeinfer.runtime.server.errors import APIError
from kubeinfer.runtime.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    _Sampling,
)
from kubeinfer.runtime.server.settings import ServerSettings

#: Characters per token of context a prompt may have before tokenizing. Text averages about 4;
#: 32 leaves room for long whitespace runs and rare long tokens.
CHARS_PER_TOKEN = 32
#: Body bytes per allowed character: JSON escapes (\\uXXXX is 6 bytes) and 4-byte UTF-8.
BYTES_PER_CHAR = 8
MIN_REQUEST_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_request_bytes: int
    max_input_chars: int
    max_prompts_per_request: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_stop_token_ids: int
    max_logit_bias: int
    max_chat_messages: int
    max_queued_requests: int
    max_queued_tokens: int

    @classmethod
    def from_settings(cls, s: ServerSettings, max_model_len: int) -> RequestLimits:
        chars = s.max_input_chars or CHARS_PER_TOKEN * max_model_len
        return cls(
            max_request_bytes=s.max_request_bytes or max(BYTES_PER_CHAR * chars, MIN_REQUEST_BYTES),
            max_input_chars=chars,
            max_prompts_per_request=s.max_prompts_per_request,
            max_stop_strings=s.max_stop_strings,
            max_stop_string_chars=s.max_stop_string_chars,
            max_stop_token_ids=s.max_stop_token_ids,
            max_logit_bias=s.max_logit_bias,
            max_chat_messages=s.max_chat_messages,
            max_queued_requests=s.max_queued_requests or 4 * s.max_num_seqs,
            max_queued_tokens=s.max_queued_tokens or 16 * s.batched_tokens(),
        )


def _too_many(field: str, what: str, cap: int, got: int) -> APIError:
    return APIError(400, f"{field}: at most {cap} {what} are allowed, got {got}", field)


def check_sampling(body: _Sampling, limits: RequestLimits) -> None:
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if len(stops) > limits.max_stop_strings:
        raise _too_many("stop", "stop strings", limits.max_stop_strings, len(stops))
    for s in stops:
        if len(s) > limits.max_stop_string_chars:
            raise APIError(
                400,
                f"stop: a stop string may have at most {limits.max_stop_string_chars} "
                f"characters, got one of {len(s)}",
                "stop",
            )
    ids = body.stop_token_ids or []
    if len(ids) > limits.max_stop_token_ids:
        raise _too_many("stop_token_ids", "token ids", limits.max_stop_token_ids, len(ids))
    bias = body.logit_bias or {}
    if len(bias) > limits.max_logit_bias:
        raise _too_many("logit_bias", "entries", limits.max_logit_bias, len(bias))


def check_sequences(num_prompts: int, n: int, limits: RequestLimits) -> None:
    """prompts x n: each is a sequence in the engine."""
    cap = limits.max_prompts_per_request
    if num_prompts * n > cap:
        field = "n" if n > 1 else "prompt"
        raise APIError(
            400,
            f"{field}: at most {cap} sequences (prompts x n) are allowed per request, got "
            f"{num_prompts} x {n}",
            field,
        )


def check_completion(body: CompletionRequest, limits: RequestLimits) -> None:
    check_sampling(body, limits)
    prompts = body.prompts()
    if len(prompts) > limits.max_prompts_per_request:
        raise _too_many("prompt", "prompts", limits.max_prompts_per_request, len(prompts))
    check_sequences(len(prompts), body.n, limits)
    for prompt in prompts:
        check_prompt_chars(prompt, limits)


def check_prompt_chars(prompt: str | list[int], limits: RequestLimits) -> None:
    if isinstance(prompt, str) and len(prompt) > limits.max_input_chars:
        raise APIError(
            400,
            f"prompt: at most {limits.max_input_chars} characters per prompt are allowed "
            f"before tokenizing, got {len(prompt)}",
            "prompt",
        )


def check_chat(body: ChatCompletionRequest, limits: RequestLimits) -> None:
    check_sampling(body, limits)
    check_sequences(1, body.n, limits)
    check_messages(body.messages, limits)


def check_messages(messages: list[ChatMessage], limits: RequestLimits) -> None:
    if len(messages) > limits.max_chat_messages:
        raise _too_many("messages", "messages", limits.max_chat_messages, len(messages))
    num_chars = sum(m.num_chars for m in messages)
    if num_chars > limits.max_input_chars:
        raise APIError(
            400,
            f"messages: at most {limits.max_input_chars} characters in all are allowed before "
            f"tokenizing, got {num_chars}",
            "messages",
        )
