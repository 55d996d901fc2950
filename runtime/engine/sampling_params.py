"""SamplingParams: how to pick each next token and when to stop. Validated on creation.

Invalid values raise `ValueError` naming the field (the server maps it to HTTP 400).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kubeinfer.runtime.engine.guided_spec import GuidedSpec

_GREEDY_BELOW = 1e-5  # temperatures under this are greedy (as vLLM)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 1.0
    """0 is greedy; higher is more random."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability sums to top_p (0 < top_p <= 1)."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 keeps all."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one (0 <= min_p <= 1)."""
    seed: int | None = None
    """Per-request seed: the same tokens whatever the batch around the request."""
    stop: list[str] = field(default_factory=list)
    """Stop when the text contains one of these; the stop string is not emitted."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Stop after one of these tokens (emitted as a token, not as text)."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence token."""
    min_tokens: int = 0
    """Generate at least this many tokens before EOS or stop tokens may end the request."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    guided: GuidedSpec | None = None
    """The output must match this schema, regex, choice or grammar (guided decoding)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _int("max_tokens", self.max_tokens, low=1)
        _int("top_k", self.top_k, low=-1)
        _int("min_tokens", self.min_tokens, low=0)
        _number("temperature", self.temperature, low=0.0)
        _number("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _number("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _int("seed", self.seed, low=-(2**63), high=2**64 - 1)  # what torch's generators take
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be a list of non-negative integers")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW


def _int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be an integer <= {high}, got {value!r}")


def _number(name: str, value: object, low: float, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value!r}")
