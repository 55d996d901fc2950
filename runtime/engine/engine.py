"""Engine: requests in, one `step()` at a time, outputs out (synchronous; AsyncEngine wraps it).

The engine knows tokens; text comes in and goes out through the tokenizer and an incremental
detokenizer per request, with stop strings applied to the text (never emitted, and held back
while a stream could still be inside one).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kubeinfer.runtime.engine.config import EngineConfig
from kubeinfer.runtime.engine.kv_cache import KVCacheManager
from kubeinfer.runtime.engine.model_runner import ModelRunner
from kubeinfer.runtime.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kubeinfer.runtime.engine.request import Request
from kubeinfer.runtime.engine.sampling_params import SamplingParams
from kubeinfer.runtime.engine.scheduler import Scheduler
from kubeinfer.runtime.loader import ProgressCallback
from kubeinfer.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    """Counters since start, and the gauges of the last step (what /metrics exports)."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_requests_finished: dict[str, int] = field(default_factory=dict)
    num_chunked_prefill_steps: int = 0
    num_steps: int = 0
    num_running: int = 0
    num_waiting: int = 0


@dataclass(slots=True)
class _Text:
    """A request's output text: detokenized so far, and how much of it has been emitted."""

    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    num_emitted: int = 0


class Engine:
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        on_progress: ProgressCallback | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        model_dir = Path(model_dir)
        self.tokenizer = (
            Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").exists() else None
        )
        self.runner = ModelRunner(model_dir, self.config, dtype, device, on_progress)
        self.max_model_len = self.runner.max_model_len
        self.kv_cache = KVCacheManager(
            self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.max_model_len,
        )
        eos = self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
        self.eos_token_ids = eos or frozenset(self.runner.model.config.eos_token_ids)
        self.stats = EngineStats()
        self._requests: dict[str, Request] = {}
        self._texts: dict[str, _Text] = {}
        self._ids = itertools.count()

    # requests in

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; ValueError (naming the problem) if it can never be served."""
        return self.add(self.make_request(prompt, params, request_id))

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Tokenize and validate, without touching engine state (safe from another thread)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self._prompt_ids(prompt)
        self._check_fits(prompt_ids, params)
        return Request(request_id, prompt_ids, params, self.eos_token_ids, prompt=prompt_text)

    def add(self, request: Request) -> str:
        """Queue a request made by `make_request`."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._requests[request.request_id] = request
        detok = (
            IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                request.sampling_params.skip_special_tokens,
            )
            if self.tokenizer
            else None
        )
        self._texts[request.request_id] = _Text(detok)
        self.scheduler.add(request)
        return request.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; its last output, or None if unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, "abort")
        return self._finish(request, [])

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # one step

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.stats.num_running = len(self.scheduler.running)
        self.stats.num_waiting = len(self.scheduler.waiting)
        if sched.is_empty:
            return []
        now = time.monotonic()
        for s in sched.scheduled:
            if s.request.times.first_scheduled is None:
                s.request.times.first_scheduled = now
        tokens = self.runner.execute(sched, self.kv_cache.block_ids)
        self.stats.num_steps += 1
        self.stats.num_chunked_prefill_steps += bool(sched.num_chunked_prefills)
        now = time.monotonic()
        outputs = []
        for s, token in zip(sched.scheduled, tokens, strict=True):
            request = s.request
            request.num_computed_tokens += s.num_new_tokens
            if token is None:
                continue
            if request.num_output_tokens == 0:
                self.stats.num_prompt_tokens += len(request.prompt_token_ids)
            self._record_token(request, token, now)
            reason = self._token_stop(request, token)
            new_text, text_reason = self._update_text(request, token, finished=reason is not None)
            reason = reason or text_reason
            if reason is not None:
                self.scheduler.finish(request, reason)
                outputs.append(self._finish(request, [token], new_text))
            else:
                outputs.append(self._output(request, [token], new_text, finished=False))
        self.stats.num_running = len(self.scheduler.running)
        self.stats.num_waiting = len(self.scheduler.waiting)
        return outputs

    # internals

    def _prompt_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give the prompt as token ids")
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids, text = list(prompt), None
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.runner.model.config.vocab_size
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {vocab})")
        return text, ids

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens; max_model_len is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        needed = min(n + params.max_tokens, self.max_model_len)
        capacity = self.kv_cache.num_blocks * self.kv_cache.block_size
        if needed > capacity:
            raise ValueError(
                f"prompt plus max_tokens needs {needed} tokens of KV cache; the pool holds "
                f"{capacity} ({self.kv_cache.num_blocks} blocks)"
            )

    def _record_token(self, request: Request, token: int, now: float) -> None:
        request.output_token_ids.append(token)
        self.stats.num_generation_tokens += 1
        times = request.times
        if times.first_token is None:
            times.first_token = now
        elif times.last_token is not None:
            times.inter_token.append(now - times.last_token)
        times.last_token = now

    def _token_stop(self, request: Request, token: int) -> str | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return "stop"
            if token in params.stop_token_ids:
                request.stop_reason = token
                return "stop"
        if request.num_output_tokens >= params.max_tokens:
            return "length"
        if request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _update_text(self, request: Request, token: int, finished: bool) -> tuple[str, str | None]:
        """Detokenize the new token; apply stop strings. Returns (text to emit, stop reason)."""
        state = self._texts[request.request_id]
        if state.detokenizer is None:
            return "", None
        start = len(state.text)
        state.text += state.detokenizer.push([token])
        if finished:
            state.text += state.detokenizer.flush()
        reason = None
        stops = request.sampling_params.stop
        if stops:
            longest = max(map(len, stops))
            window_start = max(start - longest + 1, 0)
            hits = [(i, s) for s in stops if (i := state.text.find(s, window_start)) >= 0]
            if hits:
                index, stop = min(hits)
                state.text = state.text[:index]
                request.stop_reason = stop
                reason, finished = "stop", True
        # while a stream could be in the middle of a stop string, hold its start back
        holdback = 0 if finished or not stops else max(map(len, stops)) - 1
        limit = max(len(state.text) - holdback, state.num_emitted)
        new_text = state.text[state.num_emitted : limit]
        state.num_emitted = limit
        return new_text, reason

    def _output(
        self, request: Request, new_ids: list[int], new_text: str, finished: bool
    ) -> RequestOutput:
        text = self._texts[request.request_id].text
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason if finished else None,  # type: ignore[arg-type]
            stop_reason=request.stop_reason,
            new_text=new_text,
            new_token_ids=new_ids,
        )
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            [completion],
            finished,
            metrics=_metrics(request) if finished else None,
        )

    def _finish(self, request: Request, new_ids: list[int], new_text: str = "") -> RequestOutput:
        request.times.finished = time.monotonic()
        reason = request.finish_reason or "abort"
        self.stats.num_requests_finished[reason] = (
            self.stats.num_requests_finished.get(reason, 0) + 1
        )
        self.runner.release(request.request_id)
        out = self._output(request, new_ids, new_text, finished=True)
        del self._requests[request.request_id]
        del self._texts[request.request_id]
        return out


def _metrics(request: Request) -> RequestMetrics:
    t = request.times
    return RequestMetrics(
        queue_time=(t.first_scheduled - t.arrival) if t.first_scheduled else None,
        time_to_first_token=(t.first_token - t.arrival) if t.first_token else None,
        e2e_latency=(t.finished - t.arrival) if t.finished else None,
        inter_token_latencies=list(t.inter_token),
    )
