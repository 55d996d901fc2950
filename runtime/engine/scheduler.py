"""Scheduler: each step, which requests compute how many tokens.

Contract (after vLLM v1): a step has a token budget (`max_num_batched_tokens`) and a sequence
cap (`max_num_seqs`). Running requests go first, in order, each asking for all its uncomputed
tokens (1 for a decode) within the budget; then waiting requests, first come first served,
after their prefix-cache hits. A prompt longer than the remaining budget is split into chunks
over several steps (chunked prefill), so prefills and decodes share steps. When the KV pool
runs out, the newest running request is preempted (its blocks freed, to be recomputed later);
a step that preempted admits nothing new. No torch here.
"""

from __future__ import annotations

from collections import deque

from kubeinfer.runtime.engine.kv_cache import KVCacheManager
from kubeinfer.runtime.engine.request import Request, RequestStatus
from kubeinfer.runtime.engine.sched_output import ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int = 8192,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        allocate = self.kv_cache.allocate
        scheduled = out.scheduled
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            remaining = len(request.prompt_token_ids) + len(request.output_token_ids)
            remaining -= request.num_computed_tokens
            num_new = remaining if remaining < budget else budget
            while allocate(request, num_new) is None:
                victim = running.pop()  # the newest
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new))
                if num_new < remaining:
                    out.num_chunked_prefills += 1
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: everything after it is gone too

        while self.waiting and budget > 0 and not out.preempted_ids:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting[0]
            computed, num_computed = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_computed, budget)
            if self.kv_cache.allocate(request, num_new, computed) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._schedule(out, request, num_new)
            budget -= num_new
        return out

    def finish(self, request: Request, reason: str) -> None:
        """Remove a request (stopped, at length, or aborted) and release its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache.free(request.request_id)

    def _schedule(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        scheduled = ScheduledRequest(request, num_new)
        if not scheduled.completes_prefill:
            out.num_chunked_prefills += 1
        out.scheduled.append(scheduled)

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
