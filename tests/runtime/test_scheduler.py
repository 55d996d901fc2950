"""Scheduler without a model: budgets, FCFS, chunked prefill, preemption, abort."""

from __future__ import annotations

from kubeinfer.runtime.engine.kv_cache import KVCacheManager
from kubeinfer.runtime.engine.request import Request, RequestStatus
from kubeinfer.runtime.engine.sampling_params import SamplingParams
from kubeinfer.runtime.engine.scheduler import Scheduler

_NEXT = iter(range(1000, 10**9, 1000))


def req(rid: str, n: int) -> Request:
    """Distinct tokens per request, so that no prefix-cache hit muddles the counts."""
    start = next(_NEXT)
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=1000))


def fake_step(s: Scheduler, token: int = 7) -> dict[str, int]:
    """Schedule, then do what the engine does with the (fake) model output."""
    out = s.schedule()
    done = {}
    for sr in out.scheduled:
        complete = sr.completes_prefill
        sr.request.num_computed_tokens += sr.num_new_tokens
        if complete:
            sr.request.output_token_ids.append(token)
        done[sr.request.request_id] = sr.num_new_tokens
    return done


def test_running_first_then_waiting_fcfs_within_budget() -> None:
    s = Scheduler(KVCacheManager(100, 4), max_num_seqs=8, max_num_batched_tokens=20)
    for i, n in enumerate([8, 8, 8]):
        s.add(req(f"r{i}", n))
    assert fake_step(s) == {"r0": 8, "r1": 8, "r2": 4}  # r2's prompt is chunked
    assert fake_step(s) == {"r0": 1, "r1": 1, "r2": 4}  # decodes first, then r2's rest
    assert fake_step(s) == {"r0": 1, "r1": 1, "r2": 1}


def test_long_prompt_is_chunked_and_mixed_with_decodes() -> None:
    s = Scheduler(KVCacheManager(100, 4), max_num_batched_tokens=16)
    s.add(req("short", 3))
    s.add(req("long", 40))
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [
        ("short", 3),
        ("long", 13),
    ]
    assert out.num_chunked_prefills == 1
    for sr in out.scheduled:
        sr.request.num_computed_tokens += sr.num_new_tokens
    out.scheduled[0].request.output_token_ids.append(5)
    assert fake_step(s) == {"short": 1, "long": 15}


def test_max_num_seqs_caps_admission() -> None:
    s = Scheduler(KVCacheManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        s.add(req(f"r{i}", 2))
    assert set(fake_step(s)) == {"r0", "r1"}
    assert len(s.waiting) == 2


def test_out_of_blocks_preempts_newest_and_admits_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    s = Scheduler(kv, max_num_batched_tokens=100)
    s.add(req("old", 7))
    s.add(req("new", 8))
    assert fake_step(s) == {"old": 7, "new": 8}  # 2 + 2 blocks: pool full
    s.add(req("later", 1))
    # old needs a 3rd block for token 9 (after its 8th token) -> the newest is preempted
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["old"]
    assert out.preempted_ids == ["new"]  # and "later" was not admitted in that step
    new = next(r for r in s.waiting if r.request_id == "new")
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.output_token_ids == [7]  # kept: recomputed as part of its sequence later
    assert s.num_preemptions == 1


def test_preempting_itself_when_alone_is_not_possible_to_loop() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    s = Scheduler(kv, max_num_batched_tokens=100)
    s.add(req("a", 8))
    fake_step(s)  # a holds both blocks; its next token needs a third
    out = s.schedule()
    assert out.scheduled == [] and out.preempted_ids == ["a"]


def test_finish_frees_blocks_waiting_or_running() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    s = Scheduler(kv, max_num_seqs=1)
    a, b = req("a", 5), req("b", 5)
    s.add(a)
    s.add(b)
    fake_step(s)
    s.finish(a, "abort")
    s.finish(b, "abort")
    assert kv.num_free_blocks == 10 and s.num_unfinished == 0
    assert a.status is RequestStatus.FINISHED and a.finish_reason == "abort"
