"""Engine: requests in, one `step()` at a time, outputs out (synchronous; AsyncEngine wraps it).

The engine knows tokens; text comes in and goes out through the tokenizer and an incremental
detokenizer per request, with stop strings applied to the text (never emitted, and held back
while a stream could still be inside one).

Requests are validated on the way in (validation.py: `InvalidRequestError` naming the field).
A request that fails anyway, in a step or in its post-processing, finishes alone with
finish_reason "error"; the others go on (isolation.py). `step()` raises only for a fault that
is not a request's.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kubeinfer.runtime.engine.config import EngineConfig, default_batched_tokens
from kubeinfer.runtime.engine.guided import GrammarCompiler
from kubeinfer.runtime.engine.isolation import StepFailures, failure_message
from kubeinfer.runtime.engine.kv_cache import KVCacheManager
from kubeinfer.runtime.engine.model_runner import ModelRunner
from kubeinfer.runtime.engine.output_text import OutputText
from kubeinfer.runtime.engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from kubeinfer.runtime.engine.request import Request
from kubeinfer.runtime.engine.sampler import SamplingRow
from kubeinfer.runtime.engine.sampling_params import SamplingParams
from kubeinfer.runtime.engine.sched_output import SchedulerOutput
from kubeinfer.runtime.engine.scheduler import Scheduler
from kubeinfer.runtime.engine.validation import check_fits, check_params, prompt_ids
from kubeinfer.runtime.errors import InvalidRequestError
from kubeinfer.runtime.loader import ProgressCallback
from kubeinfer.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

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
        if self.config.max_num_batched_tokens is None:
            budget = default_batched_tokens(device)
            self.config = self.config.model_copy(update={"max_num_batched_tokens": budget})
        model_dir = Path(model_dir)
        self.tokenizer = (
            Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").exists() else None
        )
        self.runner = ModelRunner(model_dir, self.config, dtype, device, on_progress)
        try:
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
            self.grammars = GrammarCompiler(
                self.tokenizer, self.runner.num_logits, self.eos_token_ids
            )
            self.failures = StepFailures(
                self.scheduler, self.runner, self.config.max_consecutive_step_failures
            )
        except BaseException:
            self.runner.close(polite=False)  # no tensor-parallel worker outlives a failed start
            raise
        self.stats = EngineStats()
        self._requests: dict[str, Request] = {}
        self._texts: dict[str, OutputText] = {}
        self._ids = itertools.count()

    # requests in

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; InvalidRequestError (naming the field) if it can never be served."""
        return self.add(self.make_request(prompt, params, request_id, cache_salt))

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Tokenize and validate, without touching engine state (safe from another thread).

        Requests share cached prefix blocks only when their `cache_salt`s are equal (e.g. one
        salt per tenant, so that no tenant can probe another's prompts by timing). A guided
        request's grammar is compiled here (cached: the server compiles it on a CPU thread
        first, so that the event loop only finds it in the cache). One request: for
        `params.n > 1`, `make_requests`."""
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidRequestError("n > 1 makes n requests: use make_requests", "n")
        return self.make_requests(prompt, params, request_id, cache_salt)[0]

    def make_requests(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> list[Request]:
        """The `params.n` sequences of one prompt, tokenized and validated once (safe from
        another thread). With n > 1, sequence i has id f"{i}_{request_id}" (vLLM's), the seed
        `seed + i` when there is one, and shares the prompt's KV blocks with sequence 0."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        vocab = self.runner.vocab_size
        text, ids = prompt_ids(prompt, self.tokenizer, vocab)
        check_params(params, vocab)
        check_fits(
            len(ids), params, self.max_model_len, self.kv_cache.num_blocks, self.kv_cache.block_size
        )
        grammar = self.grammars.compile(params.guided) if params.guided else None
        if params.n == 1:
            return [self._request(request_id, ids, params, text, cache_salt, grammar)]
        requests: list[Request] = []
        for i in range(params.n):
            # torch takes seeds modulo 2**64: seed + i stays in range, and i == 0 keeps seed
            seed = None if params.seed is None else (params.seed + i) % 2**64 if i else params.seed
            child = dataclasses.replace(params, n=1, seed=seed)
            request = self._request(f"{i}_{request_id}", ids, child, text, cache_salt, grammar)
            request.index = i
            request.shares_prompt_with = requests[0] if requests else None
            requests.append(request)
        return requests

    def _request(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        text: str | None,
        cache_salt: str | None,
        grammar: CompiledGrammar | None = None,
    ) -> Request:
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id,
            ids,
            params,
            self.eos_token_ids,
            prompt=text,
            cache_salt=cache_salt,
            grammar=grammar,
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs.append(None)  # nothing predicts the first token
        return request

    def add(self, request: Request) -> str:
        """Queue a request made by `make_request`."""
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
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
        self._texts[request.request_id] = OutputText(detok, request.sampling_params.stop)
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
    def fault(self) -> BaseException | None:
        """A fault found outside a step that stops this engine (a tensor-parallel rank that
        exited); None while it can serve."""
        return self.runner.fault

    def close(self) -> None:
        """Release what outlives the engine object: the tensor-parallel worker processes."""
        self.runner.close()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # one step

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; this step's outputs. A request that fails finishes with
        "error" and the others go on; only a fault that is not a request's raises."""
        sched = self.scheduler.schedule()
        self._update_gauges()
        rows, outputs = self._prepare(sched)
        if sched.is_empty:
            return outputs
        try:
            result = self.runner.execute(sched, self.kv_cache.block_ids, rows)
        except Exception as e:  # noqa: BLE001 - isolated below; re-raised if not a request's
            outputs += [self._fail(r, e) for r in self.failures.on_failure(sched, e)]
            self._update_gauges()
            return outputs
        self.failures.on_success()
        self.stats.num_steps += 1
        self.stats.num_chunked_prefill_steps += bool(sched.num_chunked_prefills)
        now = time.monotonic()
        for i, prompt_logprobs in result.prompt_logprobs.items():
            sched.scheduled[i].request.prompt_logprobs += prompt_logprobs
        sampled = zip(sched.scheduled, result.token_ids, result.logprobs, strict=True)
        for s, token, logprob in sampled:
            request = s.request
            request.num_computed_tokens += s.num_new_tokens
            if token is None:
                continue
            self.scheduler.clear_suspect(request)
            if logprob is not None:
                request.logprobs.append(logprob)
            try:
                outputs.append(self._emit(request, token, now, logprob))
            except Exception as e:  # noqa: BLE001 - detokenizing etc.: this request's alone
                outputs.append(self._fail(request, e))
        self._update_gauges()
        return outputs

    # internals

    def _prepare(
        self, sched: SchedulerOutput
    ) -> tuple[list[SamplingRow | None], list[RequestOutput]]:
        """The runner's per-request preparation; the requests it cannot prepare fail alone and
        leave the step (with any that depend on their blocks: see `drop_from_step`)."""
        now = time.monotonic()
        for s in sched.scheduled:
            if s.request.times.first_scheduled is None:
                s.request.times.first_scheduled = now
        rows, failures = self.runner.prepare(sched)
        if not failures:
            return rows, []
        failed = [(sched.scheduled[i].request, e) for i, e in sorted(failures.items())]
        row_of = {id(s.request): row for s, row in zip(sched.scheduled, rows, strict=True)}
        preempted = self.scheduler.drop_from_step(sched, set(failures))
        self.runner.roll_back([], [r.request_id for r in preempted])
        outputs = [self._fail(request, error) for request, error in failed]
        return [row_of[id(s.request)] for s in sched.scheduled], outputs

    def _emit(
        self, request: Request, token: int, now: float, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        """Record a sampled token, apply the stop rules, and make its output."""
        if request.num_output_tokens == 0:
            self.stats.num_prompt_tokens += len(request.prompt_token_ids)
        self._record_token(request, token, now)
        reason = self._token_stop(request, token)
        new_text, stop = self._texts[request.request_id].push(token, finished=reason is not None)
        if stop is not None:
            request.stop_reason, reason = stop, reason or "stop"
        new_logprobs = [logprob] if logprob is not None else []
        if reason is not None:
            self.scheduler.finish(request, reason)
            return self._finish(request, [token], new_text, new_logprobs=new_logprobs)
        return self._output(request, [token], new_text, False, new_logprobs=new_logprobs)

    def _fail(self, request: Request, error: Exception) -> RequestOutput:
        message = failure_message(error)
        logger.warning("request %s: %s", request.request_id, message)
        self.scheduler.finish(request, "error")
        return self._finish(request, [], error=message)

    def _update_gauges(self) -> None:
        self.stats.num_running = len(self.scheduler.running)
        self.stats.num_waiting = self.scheduler.num_waiting

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

    def _output(
        self,
        request: Request,
        new_ids: list[int],
        new_text: str,
        finished: bool,
        error: str | None = None,
        new_logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        text = self._texts[request.request_id].text
        params = request.sampling_params
        completion = CompletionOutput(
            index=request.index,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason if finished else None,  # type: ignore[arg-type]
            stop_reason=request.stop_reason,
            new_text=new_text,
            new_token_ids=new_ids,
            logprobs=list(request.logprobs) if finished and params.logprobs is not None else None,
            new_logprobs=new_logprobs or [],
        )
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            [completion],
            finished,
            metrics=_metrics(request) if finished else None,
            error=error,
            prompt_logprobs=request.prompt_logprobs if params.prompt_logprobs is not None else None,
        )

    def _finish(
        self,
        request: Request,
        new_ids: list[int],
        new_text: str = "",
        error: str | None = None,
        new_logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        request.times.finished = time.monotonic()
        reason = request.finish_reason or "abort"
        self.stats.num_requests_finished[reason] = (
            self.stats.num_requests_finished.get(reason, 0) + 1
        )
        self.runner.release(request.request_id)
        out = self._output(request, new_ids, new_text, True, error, new_logprobs)
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
