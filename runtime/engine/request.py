"""Request: one sequence's state as it moves through waiting -> running -> finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kubeinfer.runtime.engine.outputs import TokenLogprob
from kubeinfer.runtime.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestTimes:
    """Monotonic timestamps for the latency histograms (queue, TTFT, inter-token, e2e)."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    inter_token: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    cache_salt: str | None = None
    """Extra key for prefix-cache hashes (e.g. a tenant): equal salts share cached blocks."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of its full blocks (prefix cache), computed once per block."""
    times: RequestTimes = field(default_factory=RequestTimes)
    grammar: CompiledGrammar | None = None
    """Its output's grammar when `sampling_params.guided` is set (compiled by guided.py)."""
    index: int = 0
    """Which of its prompt's `n` sequences this is (the choice index)."""
    shares_prompt_with: Request | None = None
    """n > 1: the prompt's first sequence, whose prompt KV blocks this one shares."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One per output token, with `sampling_params.logprobs`."""
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """With `sampling_params.prompt_logprobs`: one per prompt token computed so far (None for
    the first)."""

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked and not all computed yet: every prompt token must be computed
        by this request (no prefix-cache hits, no shared blocks)."""
        return self.sampling_params.prompt_logprobs is not None and len(
            self.prompt_logprobs
        ) < len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building the whole list (decodes read 1 token)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
