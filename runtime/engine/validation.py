"""Request validation: every check a client's request must pass before it enters the engine.

Each failure is an `InvalidRequestError` whose `param` names the request field and whose message
names the field and the offending value ("stop_token_ids: token id 49152 is out of range
[0, 49152)"). Every token id a client can send is checked against the model's vocabulary:
out of range, it would index the embedding or the logits out of bounds on the device.
"""

from __future__ import annotations

from collections.abc import Iterable

from kubeinfer.runtime.engine.sampling_params import SamplingParams
from kubeinfer.runtime.errors import InvalidRequestError
from kubeinfer.runtime.tokenizer import Tokenizer


def check_token_ids(param: str, token_ids: Iterable[int], vocab_size: int) -> None:
    """Raise naming `param` and the first id outside [0, vocab_size)."""
    for t in token_ids:
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"{param}: token id {t} is out of range [0, {vocab_size})", param
            )


def prompt_ids(
    prompt: str | list[int], tokenizer: Tokenizer | None, vocab_size: int
) -> tuple[str | None, list[int]]:
    """(prompt text or None, its token ids), checked."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError(
                "prompt: this model has no tokenizer: give the prompt as token ids", "prompt"
            )
        ids = tokenizer.encode(prompt)
        text: str | None = prompt
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        ids, text = list(prompt), None
    else:
        raise InvalidRequestError("prompt: must be a string or a list of token ids", "prompt")
    if not ids:
        raise InvalidRequestError("prompt: must not be empty", "prompt")
    check_token_ids("prompt", ids, vocab_size)
    return text, ids


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """What SamplingParams cannot check alone: the fields that depend on the model."""
    check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    if params.logit_bias:
        check_token_ids("logit_bias", params.logit_bias, vocab_size)


def check_fits(
    num_prompt_tokens: int,
    params: SamplingParams,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
) -> None:
    """The prompt leaves room for a token under max_model_len, and prompt + max_tokens fits
    the whole KV pool (else the request could wait, or be preempted, forever)."""
    n = num_prompt_tokens
    if n >= max_model_len:
        raise InvalidRequestError(
            f"prompt: has {n} tokens; max_model_len is {max_model_len} "
            "(prompt plus at least one generated token)",
            "prompt",
        )
    needed = min(n + params.max_tokens, max_model_len)
    capacity = num_blocks * block_size
    if needed > capacity:
        raise InvalidRequestError(
            f"max_tokens: prompt plus max_tokens needs {needed} tokens of KV cache; the pool "
            f"holds {capacity} ({num_blocks} blocks)",
            "max_tokens",
        )
