"""OpenAI's logprobs shapes, from the engine's `TokenLogprob`s.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}`, the top list being the k most likely tokens, most likely first. Completions
(legacy): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, each top dict holding
the k most likely tokens and the sampled one (so up to k + 1 entries, as OpenAI documents); an
echoed prompt's first token has None for both, since nothing predicts it.

As vLLM's: a token's text is the token decoded alone with special tokens (U+FFFD for a byte
piece of a longer character, `bytes` being that text's UTF-8), `text_offset` adds up those
texts' lengths, and a logprob of -inf is sent as -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kubeinfer.runtime.engine.outputs import TokenLogprob
from kubeinfer.runtime.tokenizer import Tokenizer

FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


class TokenTexts:
    """Token id -> text for logprobs; "token_id:N" (vLLM's form) for a model without a
    tokenizer."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.token_text(token_id)


def chat_logprobs(items: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in items
        ]
    }


def completion_logprobs(
    token_ids: Sequence[int],
    items: Sequence[TokenLogprob | None],
    texts: TokenTexts,
    text_offset: int = 0,
) -> dict[str, Any]:
    """One entry per token of `token_ids` (`items` aligned with them: None for an echoed
    prompt's first token); offsets start at `text_offset`."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, items, strict=True):
        text = texts(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if lp is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(_value(lp.logprob))
        top = {texts(t): _value(v) for t, v in lp.top}
        top.setdefault(text, _value(lp.logprob))
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def next_offset(logprobs: dict[str, Any], text_offset: int) -> int:
    """The text offset after a `completion_logprobs` block (where a stream's next one starts)."""
    if not logprobs["tokens"]:
        return text_offset
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
