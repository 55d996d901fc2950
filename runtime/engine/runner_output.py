"""RunnerOutput: what one step computed, handed from the model runner back to the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from kubeinfer.runtime.engine.outputs import TokenLogprob


@dataclass(slots=True)
class RunnerOutput:
    token_ids: list[int | None]
    """One per scheduled request: the sampled token, or None (its prefill continues)."""
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """One per scheduled request: the sampled token's logprobs, when its params ask."""
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    """By scheduled index: the logprobs of the prompt tokens this step's chunk predicts (the
    next ones the request has not recorded), for requests that need prompt logprobs."""
