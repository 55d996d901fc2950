"""What the engine hands back per request: cumulative results plus this step's delta."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]
""""error": the engine failed this request alone (see `RequestOutput.error`); others go on."""


@dataclass(slots=True)
class TokenLogprob:
    """One position's log-probabilities (float32 log-softmax of the model's raw logits)."""

    token_id: int
    """The token at this position (sampled, or the prompt's)."""
    logprob: float
    top: list[tuple[int, float]]
    """The most likely tokens (as many as asked), most likely first: (token id, logprob)."""


@dataclass(slots=True)
class CompletionOutput:
    index: int
    """Which of the prompt's `n` sequences this is."""
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request, if any."""
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    """With `SamplingParams.logprobs`: one per token of `token_ids`, on the final output only
    (streams read `new_logprobs`)."""
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    """This step's: one per token of `new_token_ids` (with `SamplingParams.logprobs`)."""


@dataclass(slots=True)
class RequestMetrics:
    """Seconds, for the server's histograms; filled in as the request goes."""

    queue_time: float | None = None
    time_to_first_token: float | None = None
    e2e_latency: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    """Why the engine failed the request (finish_reason "error"): one line, never a traceback."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With `SamplingParams.prompt_logprobs`: one per prompt token (None for the first, which
    nothing predicts), from the first sampled token's output on."""
