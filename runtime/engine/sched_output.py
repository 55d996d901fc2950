"""SchedulerOutput: what one engine step computes, handed from the scheduler to the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from kubeinfer.runtime.engine.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    """Tokens computed this step, from `request.num_computed_tokens` on."""

    @property
    def completes_prefill(self) -> bool:
        """True when this step reaches the request's last known token, so a token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    num_chunked_prefills: int = 0
    """Requests whose prompt did not fit this step and continues in a later one."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
