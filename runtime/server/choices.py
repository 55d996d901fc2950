"""One response choice (a sequence of a prompt) in OpenAI's shape, whole or as stream deltas.

A choice's stream sends text as the engine finalizes it (stop strings and incomplete
characters are held back) and the logprobs of its tokens along with that text: a token whose
text is still held back has its logprobs sent with the chunk that carries the text. With
`echo`, the choice's first chunk starts with the prompt's text (and its logprobs); with
`max_tokens` 0 and `echo`, the choice is the prompt alone: the one token the engine generated
for it is dropped, and not counted in `usage`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kubeinfer.runtime.engine.outputs import RequestOutput, TokenLogprob
from kubeinfer.runtime.server.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    next_offset,
)
from kubeinfer.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from kubeinfer.runtime.server.tool_calls import ToolCallStream, parse_output, tool_finish_reason


@dataclass(slots=True)
class Job:
    """One sequence of a request, validated and ready to stream."""

    prompt_ids: list[int]
    stream: Any  # AsyncIterator[RequestOutput]
    index: int = 0
    """The choice's index in the response (prompt index x n + sequence index, as vLLM's)."""
    prompt_index: int = 0
    prompt_text: str = ""
    """The prompt's text, for echo."""


def usage(jobs: list[Job], outs: list[RequestOutput], count_output: bool = True) -> dict[str, int]:
    """Each prompt's tokens once, however many sequences it has (as vLLM's)."""
    prompt = sum({j.prompt_index: len(j.prompt_ids) for j in jobs}.values())
    completion = sum(len(o.outputs[0].token_ids) for o in outs) if count_output else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


@dataclass(slots=True)
class CompletionChoice:
    job: Job
    body: CompletionRequest
    texts: TokenTexts
    echo_pending: bool = False
    text_offset: int = 0
    pending: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.echo_pending = self.body.echo

    @property
    def keeps_output(self) -> bool:
        return self.body.max_tokens != 0

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        c = out.outputs[0]
        text = self.job.prompt_text if self.body.echo else ""
        token_ids: list[int] = []
        items: list[TokenLogprob | None] = []
        if self.body.echo and self.body.logprobs is not None:
            token_ids += self.job.prompt_ids
            items += out.prompt_logprobs or [None] * len(self.job.prompt_ids)
        if self.keeps_output:
            text += c.text
            token_ids += c.token_ids
            items += c.logprobs or []
        return self._choice(text, token_ids, items, out)

    def delta(self, out: RequestOutput) -> dict[str, Any] | None:
        """This output's chunk choice, or None when it has nothing to send yet."""
        c = out.outputs[0]
        token_ids: list[int] = []
        items: list[TokenLogprob | None] = []
        text = ""
        if self.echo_pending:
            self.echo_pending = False
            text = self.job.prompt_text
            if self.body.logprobs is not None:
                token_ids += self.job.prompt_ids
                items += out.prompt_logprobs or [None] * len(self.job.prompt_ids)
        if self.keeps_output:
            self.pending += c.new_logprobs
            if c.new_text or out.finished:
                text += c.new_text
                token_ids += [lp.token_id for lp in self.pending]
                items += self.pending
                self.pending = []
        if not text and not out.finished:
            return None
        return self._choice(text, token_ids, items, out)

    def _choice(
        self,
        text: str,
        token_ids: list[int],
        items: list[TokenLogprob | None],
        out: RequestOutput,
    ) -> dict[str, Any]:
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = completion_logprobs(token_ids, items, self.texts, self.text_offset)
            self.text_offset = next_offset(logprobs, self.text_offset)
        c = out.outputs[0]
        return {
            "index": self.job.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason if out.finished else None,
            "stop_reason": c.stop_reason,
        }


@dataclass(slots=True)
class ChatChoice:
    """A chat choice: its text as content, or as tool calls when the request has tools and
    the model made calls (tool_calls.py). In a stream, text that may still become a call is
    held back, and calls go out whole in one `delta.tool_calls` entry before the finish chunk;
    logprobs go with the next chunk that is sent after their tokens."""

    job: Job
    body: ChatCompletionRequest
    texts: TokenTexts
    pending: list[TokenLogprob] = field(default_factory=list)
    tools: ToolCallStream | None = None

    def __post_init__(self) -> None:
        self.tools = ToolCallStream(self.body)

    def first(self) -> dict[str, Any]:
        """The stream's first chunk of this choice: the role."""
        delta = {"role": "assistant", "content": ""}
        return {"index": self.job.index, "delta": delta, "logprobs": None, "finish_reason": None}

    def whole(self, out: RequestOutput) -> dict[str, Any]:
        c = out.outputs[0]
        logprobs = chat_logprobs(c.logprobs or [], self.texts) if self.body.logprobs else None
        content, calls = parse_output(c.text, self.body)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        return {
            "index": self.job.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": tool_finish_reason(c.finish_reason, calls, self.body),
            "stop_reason": c.stop_reason,
        }

    def deltas(self, out: RequestOutput) -> list[dict[str, Any]]:
        """This output's chunk choices (none while it has nothing to send)."""
        assert self.tools is not None
        c = out.outputs[0]
        self.pending += c.new_logprobs
        text = self.tools.push(c.new_text)
        finish_reason = c.finish_reason if out.finished else None
        chunks: list[dict[str, Any]] = []
        if out.finished:
            rest, calls = self.tools.finish()
            text += rest
            if calls:  # each call whole, in one delta, before the finish chunk
                finish_reason = tool_finish_reason(finish_reason, calls, self.body)
                if text:
                    chunks.append(self._chunk({"content": text}, None, c.stop_reason))
                    text = ""
                calls_delta = {"tool_calls": [call.as_openai(i) for i, call in enumerate(calls)]}
                chunks.append(self._chunk(calls_delta, None, c.stop_reason))
        if text or out.finished:
            delta = {"content": text} if text else {}
            chunks.append(self._chunk(delta, finish_reason, c.stop_reason))
        return chunks

    def _chunk(
        self, delta: dict[str, Any], finish_reason: str | None, stop_reason: int | str | None
    ) -> dict[str, Any]:
        logprobs = None
        if self.body.logprobs:
            logprobs = chat_logprobs(self.pending, self.texts)
            self.pending = []
        return {
            "index": self.job.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
