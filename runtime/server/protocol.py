"""Request bodies of the OpenAI API (completions, chat, tokenize), validated with pydantic.

Fields OpenAI defines that kubeinfer does not implement are accepted at their neutral value
and refused otherwise with a message saying so (suffix, best_of other than n, ...);
fields OpenAI does not define are refused by name. vLLM's extensions (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, min_tokens, skip_special_tokens, cache_salt)
are supported, and structured outputs (response_format and vLLM's guided_* fields:
protocol_guided.py), and tool calling (tools, tool_choice, tool messages: protocol_tools.py).
Sizes the server caps by its settings (prompts, n, stop strings, logit_bias entries, messages,
characters) are checked in limits.py; token ids against the vocabulary in the engine.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from kubeinfer.runtime.engine.guided_spec import GuidedSpec
from kubeinfer.runtime.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from kubeinfer.runtime.server.protocol_guided import GuidedFields
from kubeinfer.runtime.server.protocol_tools import ToolCall, ToolFields

TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
MAX_N = 128
"""The schema's bound on `n` (OpenAI's); the server's own cap is `--max-n`."""
MAX_COMPLETION_LOGPROBS = 5
"""Completions' `logprobs` (OpenAI's bound); chat's `top_logprobs` goes to 20."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(GuidedFields):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """Prefix-cache key: requests share cached prompt blocks only with equal salts (tenants)."""
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, as OpenAI's) -> bias in [-100, 100]; ids checked in the engine."""

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"keys must be token ids (integers >= 0), got {key[:20]!r}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"values must be in [-100, 100], got {value} for token {key}")
        return bias

    @model_validator(mode="after")
    def _unsupported(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        for value in self._unsupported_extras():
            raise ValueError(value)
        self.guided_spec()  # at most one structured output field, within its size caps
        return self

    def _unsupported_extras(self) -> list[str]:
        return []

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _logprobs(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) for SamplingParams."""
        return None, None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        logprobs, prompt_logprobs = self._logprobs()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, max_tokens),
            skip_special_tokens=self.skip_special_tokens,
            guided=self.guided_spec(),
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class CompletionRequest(_Sampling):
    prompt: (
        Annotated[StrictStr, Field(min_length=1)]
        | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    max_tokens: int | None = Field(None, ge=0)
    """0 only with echo: the prompt back (with its logprobs), nothing generated (as vLLM)."""
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    def _unsupported_extras(self) -> list[str]:
        errors = []
        if self.max_tokens == 0 and not self.echo:
            errors.append("max_tokens: must be >= 1 (0 only with echo=true)")
        if self.best_of is not None and self.best_of < self.n:
            errors.append(f"best_of: must be >= n (best_of {self.best_of}, n {self.n})")
        if self.best_of is not None and self.best_of > self.n:
            errors.append(
                f"best_of: best_of > n is not supported (best_of {self.best_of}, n {self.n}); "
                "ask for n completions and rank them yourself"
            )
        if self.suffix:
            errors.append("suffix: not supported")
        return errors

    def _logprobs(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, str) for x in p):
            return list(p)  # type: ignore[arg-type]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return [list(x) for x in p]  # type: ignore[union-attr]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None
    """An assistant turn's calls (rendered by the chat template)."""
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None
    """A tool turn's answer to this call."""

    @property
    def num_chars(self) -> int:
        content = self.content
        if isinstance(content, list):
            num = sum(len(part.text) for part in content)
        else:
            num = len(content or "")
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or [])
        return num + calls + len(self.name or "") + len(self.tool_call_id or "")

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            # templates read arguments as an object (`| tojson`), as transformers passes them
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _json_object(c)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and role == "tool":
            message["name"] = self.name
        return message


def _json_object(call: ToolCall) -> dict[str, Any] | str:
    try:
        value = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments
    return value if isinstance(value, dict) else call.function.arguments


class ChatCompletionRequest(_Sampling, ToolFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True

    def _unsupported_extras(self) -> list[str]:
        errors = []
        if self.top_logprobs and not self.logprobs:
            errors.append("top_logprobs: needs logprobs=true")
        if self.max_tokens and self.max_completion_tokens:
            errors.append("give max_tokens or max_completion_tokens, not both")
        return errors

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def guided_spec(self) -> GuidedSpec | None:
        """A structured output field's spec, or the grammar of tool_choice required/named."""
        self.check_tools()
        spec, tool_spec = super().guided_spec(), self.tool_guided_spec()
        if spec is not None and tool_spec is not None:
            raise ValueError(f"tool_choice {self.tool_mode} cannot be combined with {spec.param}")
        return tool_spec or spec

    def _logprobs(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None
