"""SamplingParams: how to pick each next token and when to stop. Validated on creation.

Invalid values raise `ValueError` naming the field (the server maps it to HTTP 400). The fields
and their ranges are vLLM's; token ids (stop_token_ids, logit_bias) are checked against the
model's vocabulary when the engine takes the request (validation.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kubeinfer.runtime.engine.guided_spec import GuidedSpec

_GREEDY_BELOW = 1e-5  # temperatures under this are greedy (as vLLM)
MAX_LOGPROBS = 20
"""Most top logprobs per token (OpenAI's chat limit, vLLM's default `max_logprobs`)."""
MAX_LOGIT_BIAS = 100.0
"""logit_bias values lie in [-100, 100] (OpenAI's range)."""


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
    n: int = 1
    """Sequences to generate from the prompt (the offline API returns them as `outputs`; the
    engine runs them as sibling requests sharing the prompt's KV blocks)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (-2 <= x <= 2)."""
    frequency_penalty: float = 0.0
    """Subtracted once per time a token was generated (-2 <= x <= 2)."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or the output
    (0 < x <= 2; 1 is off)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling (values in [-100, 100])."""
    logprobs: int | None = None
    """Return the log-probability of each sampled token and of the `logprobs` most likely ones
    (0 <= x <= 20): the raw model distribution (float32 log-softmax of the logits, before
    penalties, biases and temperature), as vLLM's default."""
    prompt_logprobs: int | None = None
    """Also for every prompt token after the first (its prompt is computed whole: no prefix
    cache hits, no shared blocks)."""

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
        _int("n", self.n, low=1)
        _number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _number("repetition_penalty", self.repetition_penalty, low=0.0, high=2.0)
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty must be in (0, 2], got 0")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        """Presence, frequency or repetition penalty on: the sampler counts this request's
        tokens."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )


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


def _logit_bias(bias: object) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must map token ids to numbers")
    out: dict[int, float] = {}
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias: keys must be token ids (integers >= 0), got {token!r}")
        _number(f"logit_bias[{token}]", value, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
        out[token] = float(value)
    return out
