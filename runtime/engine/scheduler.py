"""Scheduler: each step, which requests compute how many tokens.

Contract (after vLLM v1): a step has a token budget (`max_num_batched_tokens`) and a sequence
cap (`max_num_seqs`). Running requests go first, in order, each asking for all its uncomputed
tokens (1 for a decode) within the budget; then waiting requests, first come first served,
after their prefix-cache hits. A prompt longer than the remaining budget is split into chunks
over several steps (chunked prefill), so prefills and decodes share steps. When the KV pool
runs out, the newest running request is preempted (its blocks freed, to be recomputed later);
a step that preempted admits nothing new. No torch here.

The sequences of an n > 1 request are requests of their own; sequences 1..n-1 start with the
full prompt blocks of sequence 0 (`Request.shares_prompt_with`), shared by reference count,
waiting at the head of the queue until sequence 0 has them (see `_computed_blocks`).

Finishing a request is O(1) wherever it is (an abort of one of 20,000 queued requests must not
walk the queue): a waiting request is only marked finished and skipped when it reaches the head
of `waiting`, so `len(waiting)` over-counts: count with `num_waiting` (O(1), and it includes
the suspects below, which wait too).

Isolation (after a step failed and `roll_back` ran; see isolation.py): the failed step's
requests are suspects. While any is left, every step runs exactly one suspect alone (chunked
prefill allowed) until it samples a token (`clear_suspect`) or fails; other requests wait.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

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
        """FIFO; may hold finished requests (lazy deletion): count with `num_waiting`."""
        self.running: list[Request] = []
        self.suspects: deque[Request] = deque()
        """Requests of a failed step, not yet run alone again (at most max_num_seqs)."""
        self.isolated: Request | None = None
        """The suspect running alone now (also in `running`)."""
        self._num_live = 0  # unfinished requests in `waiting`
        self.num_queued = 0
        """Waiting requests that never ran (a preempted request is not queued again)."""
        self.num_queued_tokens = 0
        """Their prompt tokens."""
        self.num_preemptions = 0
        self._num_dead = 0  # finished requests still in `waiting`

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be scheduled (queued, preempted, suspects). O(1)."""
        return self._num_live + len(self.suspects)

    @property
    def num_unfinished(self) -> int:
        return self.num_waiting + len(self.running)

    @property
    def is_isolating(self) -> bool:
        return self.isolated is not None or bool(self.suspects)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self._num_live += 1
        self.num_queued += 1
        self.num_queued_tokens += len(request.prompt_token_ids)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.is_isolating:
            return self._schedule_isolated(out)
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

        while budget > 0 and not out.preempted_ids and len(self.running) < self.max_num_seqs:
            request = self._waiting_head()
            if request is None:
                break
            shared = self._computed_blocks(request, out)
            if shared is None:
                break  # its first sequence is still computing the prompt it will share
            computed, num_computed = shared
            num_new = min(request.num_tokens - num_computed, budget)
            if self.kv_cache.allocate(request, num_new, computed) is None:
                break
            self.waiting.popleft()
            self._num_live -= 1
            self._admit(request, num_computed)
            self._schedule(out, request, num_new)
            budget -= num_new
        return out

    def finish(self, request: Request, reason: str) -> None:
        """Remove a request (stopped, at length, aborted, failed) and release its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)  # bounded by max_num_seqs
            if request is self.isolated:
                self.isolated = None
        elif request.status is not RequestStatus.FINISHED:
            if self.suspects and request in self.suspects:  # bounded by max_num_seqs
                self.suspects.remove(request)
            else:
                self._forget_waiting(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache.free(request.request_id)

    def roll_back(self, step: SchedulerOutput) -> list[Request]:
        """Undo a step that failed as a batch: nothing of it was computed. Every running request
        is preempted (recomputed later); the step's requests become suspects, in order, and the
        others go back to the front of `waiting`. Returns the preempted requests."""
        for s in step.scheduled:
            self.forget_step_blocks(s.request)
        in_step = {id(s.request) for s in step.scheduled}
        preempted = list(self.running)
        for request in reversed(preempted):  # appendleft: reversed keeps their order
            self._preempt(request, to=self.suspects if id(request) in in_step else self.waiting)
        self.running.clear()
        return preempted

    def drop_from_step(self, step: SchedulerOutput, failed: set[int]) -> list[Request]:
        """Take the requests at indexes `failed` out of `step` (the caller finishes them); the
        rest of the step runs. Their blocks of this step will hold no KV, so they leave the
        prefix cache, and a request admitted after them in this step with a prefix hit on one
        of those blocks must not run either: it is preempted, to recompute. Returns those."""
        bs = self.kv_cache.block_size
        unwritten: set[int] = set()
        kept: list[ScheduledRequest] = []
        preempted: list[Request] = []
        for i, s in enumerate(step.scheduled):
            request = s.request
            block_ids = self.kv_cache.block_ids(request.request_id)
            if i not in failed and unwritten.isdisjoint(block_ids):
                kept.append(s)
                continue
            # hits come only from requests earlier in the step: one pass is the whole closure
            unwritten.update(block_ids[request.num_computed_tokens // bs :])
            self.forget_step_blocks(request)
            if i not in failed:
                self.running.remove(request)
                self._preempt(request)
                preempted.append(request)
        step.scheduled = kept
        step.num_chunked_prefills = sum(not s.completes_prefill for s in kept)
        return preempted

    def forget_step_blocks(self, request: Request) -> None:
        """The blocks a failed step was to write hold no valid KV: drop their cache hashes
        (allocate() registered them before compute), so no later request reuses them."""
        first = request.num_computed_tokens // self.kv_cache.block_size
        self.kv_cache.uncache_blocks(request.request_id, first)

    def clear_suspect(self, request: Request) -> None:
        """`request` sampled a token alone: it is a normal running request again."""
        if request is self.isolated:
            self.isolated = None

    # internals

    def _schedule_isolated(self, out: SchedulerOutput) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        request = self.isolated
        if request is None:
            request = self.suspects[0]
            computed, num_computed = self._computed_blocks(request, out) or ([], 0)
            num_new = min(request.num_tokens - num_computed, budget)
            if not self._make_room(out, request, num_new, computed):
                return out
            self._admit(self.suspects.popleft(), num_computed)
            self.isolated = request
        else:
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._make_room(out, request, num_new):
                return out
        self._schedule(out, request, num_new)
        return out

    def _make_room(
        self, out: SchedulerOutput, request: Request, num_new: int, computed: Sequence[int] = ()
    ) -> bool:
        """Allocate for the suspect, preempting the newest other running requests if needed."""
        while self.kv_cache.allocate(request, num_new, computed) is None:
            victim = next((r for r in reversed(self.running) if r is not request), None)
            if victim is None:
                return False
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
        return True

    def _computed_blocks(
        self, request: Request, out: SchedulerOutput
    ) -> tuple[list[int], int] | None:
        """Blocks a request admitted now starts with, and the tokens they hold: prefix-cache
        hits or, for a sequence of an n > 1 request, the full prompt blocks of the prompt's
        first sequence (shared by reference count, never copied; the partial last block and
        the last prompt token are computed by each sequence). None: wait, the first sequence
        runs and has not reached those blocks yet. Blocks the first sequence computes in this
        very step may be shared: every layer stores the step's KV before it attends (as with a
        prefix hit on a block computed in the same step). A request that needs prompt logprobs
        computes its whole prompt itself."""
        if request.needs_prompt_logprobs:
            return [], 0
        leader = request.shares_prompt_with
        if leader is None or leader.status is not RequestStatus.RUNNING:
            # no sharing (the first sequence finished, or waits): as any other request
            return self.kv_cache.get_computed_blocks(request)
        bs = self.kv_cache.block_size
        num_shared = min(len(request.prompt_token_ids), request.num_tokens - 1) // bs
        in_step = (s.num_new_tokens for s in out.scheduled if s.request is leader)
        if leader.num_computed_tokens + next(in_step, 0) < num_shared * bs:
            return None
        hits = self.kv_cache.get_computed_blocks(request)
        if len(hits[0]) >= num_shared:
            return hits
        shared = self.kv_cache.block_ids(leader.request_id)[:num_shared]
        return list(shared), num_shared * bs

    def _admit(self, request: Request, num_computed: int) -> None:
        if request.status is RequestStatus.WAITING:  # first time it runs
            self.num_queued -= 1
            self.num_queued_tokens -= len(request.prompt_token_ids)
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _waiting_head(self) -> Request | None:
        """The first unfinished waiting request (finished ones are dropped on the way)."""
        waiting = self.waiting
        while waiting and waiting[0].status is RequestStatus.FINISHED:
            waiting.popleft()
            self._num_dead -= 1
        return waiting[0] if waiting else None

    def _forget_waiting(self, request: Request) -> None:
        """O(1) removal from `waiting`: the entry stays, marked finished by the caller."""
        self._num_live -= 1
        if request.status is RequestStatus.WAITING:
            self.num_queued -= 1
            self.num_queued_tokens -= len(request.prompt_token_ids)
        self._num_dead += 1
        # compact when the dead outnumber the living, so memory stays bounded (amortized O(1))
        if self._num_dead > 1024 and self._num_dead > self._num_live:
            live = [r for r in self.waiting if r is not request and not r.is_finished]
            self.waiting = deque(live)
            self._num_dead = 0

    def _schedule(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        scheduled = ScheduledRequest(request, num_new)
        if not scheduled.completes_prefill:
            out.num_chunked_prefills += 1
        out.scheduled.append(scheduled)

    def _preempt(self, request: Request, to: deque[Request] | None = None) -> None:
        """Free its blocks; it goes to the front of `to` (default `waiting`) to recompute."""
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if to is None or to is self.waiting:
            self.waiting.appendleft(request)
            self._num_live += 1
        else:
            to.appendleft(request)
