"""One bad request never takes the engine down (issue #14): validation at the boundary, and
fault isolation for whatever gets past it (pinned in prepare, or rolled back and isolated).

Faults that get past validation are made two ways: a `Request` built by hand and added with
`engine.add` (an out-of-range prompt or stop token id), and a wrapper around the runner's
`execute` that raises for steps holding a request whose id says so ("fault-": always, before
compute; "flaky-": only when batched with others, after the step has computed and sampled).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kubeinfer.runtime import LLM, SamplingParams
from kubeinfer.runtime.engine.async_engine import AsyncEngine, RequestFailedError
from kubeinfer.runtime.engine.config import EngineConfig
from kubeinfer.runtime.engine.engine import Engine
from kubeinfer.runtime.engine.outputs import RequestOutput
from kubeinfer.runtime.engine.request import Request
from kubeinfer.runtime.engine.runner_output import RunnerOutput
from kubeinfer.runtime.errors import InvalidRequestError

VOCAB = 384  # the tiny models' vocabulary
PREFIXES = [[], list(range(10, 27)), list(range(10, 42)), list(range(100, 117))]
_IDS = itertools.count()


class Faults:
    """Wraps `engine.runner.execute` with the injected faults; counts what it raised (and the
    steps that preempted)."""

    def __init__(self, engine: Engine) -> None:
        self.real = engine.runner.execute
        self.raised: Counter[str] = Counter()
        engine.runner.execute = self  # type: ignore[method-assign]

    def __call__(self, out: Any, block_ids: Any, rows: Any) -> RunnerOutput:
        ids = [s.request.request_id for s in out.scheduled]
        self.raised["preempting steps"] += bool(out.preempted_ids)
        if any(i.startswith("fault-") for i in ids):
            self.raised["fault" if len(ids) == 1 else "batch"] += 1
            raise IndexError("index out of range in self")
        tokens = self.real(out, block_ids, rows)
        if len(ids) > 1 and any(i.startswith("flaky-") for i in ids):
            self.raised["batch"] += 1
            raise RuntimeError("a fault after the step computed and sampled")
        return tokens


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, Path]) -> Engine:
    config = EngineConfig(num_kv_blocks=6, max_num_batched_tokens=32)
    engine = Engine(tiny_models["llama-gqa"], config, dtype="float32")
    engine.faults = Faults(engine)  # type: ignore[attr-defined]
    return engine


def run_alone(engine: Engine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    rid = engine.add_request(prompt, params)
    done = None
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished and out.request_id == rid:
                done = out
    assert done is not None
    return done


_ALONE: dict[tuple[tuple[int, ...], str], RequestOutput] = {}


def alone(engine: Engine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    """The request's output when it runs alone (cached per prompt and params)."""
    key = (tuple(prompt), repr(params))
    if key not in _ALONE:
        _ALONE[key] = run_alone(engine, prompt, params)
    return _ALONE[key]


def assert_idle_and_whole(engine: Engine) -> None:
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert not engine.has_unfinished and engine.scheduler.num_queued == 0
    assert engine.scheduler.isolated is None and not engine.scheduler.suspects
    assert not engine._requests  # the engine's own bookkeeping holds no leftover
    assert engine.runner.token_counts.num_rows == 0  # nor the penalties' token counts
    assert not engine.runner.block_tables._rows


# validation at the boundary


@pytest.mark.parametrize(
    ("prompt", "kwargs", "param", "message"),
    [
        ([1, 2], {"stop_token_ids": [5, VOCAB]}, "stop_token_ids", f"token id {VOCAB} is out"),
        ([1, VOCAB + 7], {}, "prompt", f"prompt: token id {VOCAB + 7} is out of range"),
        ([], {}, "prompt", "prompt: must not be empty"),
        ([1] * 600, {}, "prompt", "max_model_len is 512"),
        ([1, 2], {"max_tokens": 400}, "max_tokens", "the pool holds 96"),
    ],
)
def test_make_request_names_the_field(
    engine: Engine, prompt: list[int], kwargs: dict, param: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message) as e:
        engine.make_request(prompt, SamplingParams(**kwargs))
    assert e.value.param == param
    assert isinstance(e.value, ValueError)  # callers that catch ValueError still do


def test_the_issue_14_request_is_rejected(engine: Engine) -> None:
    params = SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[VOCAB])
    with pytest.raises(InvalidRequestError, match=rf"stop_token_ids: token id {VOCAB} is out"):
        engine.add_request([1, 2, 3], params)
    assert_idle_and_whole(engine)


def test_cache_salt_separates_prefix_caches(tiny_models: dict[str, Path]) -> None:
    # a pool roomy enough that no cached block is evicted on the way
    engine = Engine(tiny_models["llama-gqa"], EngineConfig(num_kv_blocks=64), dtype="float32")
    prompt = list(range(200, 250))  # three full blocks
    params = SamplingParams(temperature=0, max_tokens=2)

    def hit_tokens(salt: str | None) -> int:
        stats = engine.kv_cache.prefix_stats
        before = stats.num_hit_tokens
        rid = engine.add_request(prompt, params, cache_salt=salt)
        while engine.has_unfinished:
            engine.step()
        assert rid not in engine._requests
        return stats.num_hit_tokens - before

    assert hit_tokens("tenant-a") == 0
    assert hit_tokens("tenant-b") == 0  # same prompt, another salt: no shared block
    assert hit_tokens("tenant-a") == 48
    assert hit_tokens(None) == 0
    assert hit_tokens(None) == 48


# faults that get past validation


def poison(engine: Engine, prompt: list[int], params: SamplingParams) -> str:
    """Add a request without validation, as a bug upstream might."""
    rid = f"poison-{next(_IDS)}"
    engine.add(Request(rid, prompt, params, engine.eos_token_ids))
    return rid


def run_all(engine: Engine) -> dict[str, RequestOutput]:
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def test_poison_requests_fail_alone_in_a_batch(engine: Engine) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(20, 60)), [9]]
    good = [engine.add_request(p, greedy) for p in prompts]
    bad_stop = poison(engine, [1, 2, 3], SamplingParams(min_tokens=1, stop_token_ids=[VOCAB]))
    bad_prompt = poison(engine, [1, VOCAB + 5, 3], greedy)
    errors_before = engine.stats.num_requests_finished.get("error", 0)
    done = run_all(engine)
    for rid, p in zip(good, prompts, strict=True):
        assert done[rid].outputs[0].token_ids == alone(engine, p, greedy).outputs[0].token_ids
    for rid, field in [(bad_stop, "stop_token_ids"), (bad_prompt, "prompt")]:
        out = done[rid]
        assert out.finished and out.outputs[0].finish_reason == "error"
        assert out.error is not None and "Traceback" not in out.error
        assert out.error.startswith(f"request failed in the engine: InvalidRequestError: {field}")
    assert engine.stats.num_requests_finished["error"] == errors_before + 2
    assert_idle_and_whole(engine)


def test_a_failing_batch_is_rolled_back_and_the_culprit_found(engine: Engine) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    good = [("req", [3, 4, 5], greedy), ("req", list(range(30, 70)), seeded)]
    good.append(("flaky", [7, 7, 7], seeded))  # fails each batch it is in, after sampling
    ids = [engine.add_request(p, sp, request_id=f"{k}-{next(_IDS)}") for k, p, sp in good]
    culprit = engine.add_request([8, 9], greedy, request_id=f"fault-{next(_IDS)}")
    batches = engine.faults.raised["batch"]  # type: ignore[attr-defined]
    done = run_all(engine)
    assert engine.faults.raised["batch"] > batches  # type: ignore[attr-defined]
    assert done[culprit].outputs[0].finish_reason == "error"
    assert done[culprit].error == (
        "request failed in the engine: IndexError: index out of range in self"
    )
    for rid, (_, prompt, params) in zip(ids, good, strict=True):
        assert done[rid].outputs[0].token_ids == alone(engine, prompt, params).outputs[0].token_ids
    assert_idle_and_whole(engine)


def test_an_error_in_post_processing_fails_only_that_request(engine: Engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a = engine.add_request([1, 2, 3], params)
    b = engine.add_request([4, 5, 6], params)

    class Broken:
        text = ""

        def push(self, token: int, finished: bool) -> tuple[str, str | None]:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    engine._texts[a] = Broken()  # type: ignore[assignment]
    done = run_all(engine)
    assert done[a].outputs[0].finish_reason == "error" and "UnicodeDecodeError" in str(
        done[a].error
    )
    assert done[b].outputs[0].token_ids == alone(engine, [4, 5, 6], params).outputs[0].token_ids
    assert_idle_and_whole(engine)


def test_llm_generate_returns_failed_requests_like_any_other(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(tiny_models["llama-gqa"], dtype="float32", num_kv_blocks=16)
    execute = llm.engine.runner.execute

    def failing(out: Any, block_ids: Any, rows: Any) -> list[int | None]:
        if any(s.request.prompt_token_ids[0] == 13 for s in out.scheduled):
            raise IndexError("index out of range in self")
        return execute(out, block_ids, rows)

    monkeypatch.setattr(llm.engine.runner, "execute", failing)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([[5, 6], [13, 14], [7]], params)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error == "request failed in the engine: IndexError: index out of range in self"


def test_a_fault_that_is_not_a_request_stops_the_engine(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(temperature=0, max_tokens=2)
    device_lost = RuntimeError("CUDA error: an illegal memory access was encountered")

    def lost(*_: Any) -> None:
        raise device_lost

    monkeypatch.setattr(engine.runner, "execute", lost)
    engine.add_request([1, 2], params)
    with pytest.raises(RuntimeError, match="CUDA error"):
        engine.step()  # fatal for the device: at once
    for rid in list(engine._requests):
        engine.abort(rid)

    monkeypatch.setattr(engine.runner, "execute", engine.faults)  # type: ignore[attr-defined]
    ids = [engine.add_request([i, 1], params, request_id=f"fault-{i}") for i in range(1, 5)]
    outs: list[RequestOutput] = []
    with pytest.raises(IndexError):
        while engine.has_unfinished:  # K = 3 solo failures in a row: not the requests' fault
            outs += engine.step()
    assert [o.request_id for o in outs] == ids[:2]
    assert all(o.outputs[0].finish_reason == "error" for o in outs)
    for rid in list(engine._requests):
        engine.abort(rid)
    run_alone(engine, [1, 2], params)  # a good step resets the count
    assert engine.failures.num_consecutive_failures == 0
    assert_idle_and_whole(engine)


# the property: random mixes of good, poisoned, faulty and aborted requests


@dataclass(frozen=True)
class Spec:
    kind: str  # good | bad_prompt | bad_stop | fault | flaky
    prompt: tuple[int, ...]
    params: SamplingParams
    arrival: int  # the step it is added before
    abort_at: int | None  # the step it is aborted before, if any


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    kind = draw(st.sampled_from(["good"] * 6 + ["bad_prompt", "bad_stop", "fault", "flaky"]))
    greedy = draw(st.booleans())
    max_tokens = draw(st.integers(1, 8))
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        temperature=0.0 if greedy else draw(st.sampled_from([0.7, 1.0, 1.3])),
        top_k=draw(st.sampled_from([0, 1, 5, 50])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.5])),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.3])),
        seed=None if greedy else draw(st.integers(0, 2**32)),
        stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)),
        ignore_eos=draw(st.booleans()),
        # penalties, biases and logprobs (#18): the same tokens alone and in any batch too
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 1.5])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3])),
        logit_bias=draw(st.none() | st.dictionaries(st.integers(0, VOCAB - 1),
                                                    st.sampled_from([-5.0, 3.0]), max_size=3)),
        logprobs=draw(st.none() | st.integers(0, 3)),
    )
    suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
    prompt = [*draw(st.sampled_from(PREFIXES)), *suffix]
    if kind == "bad_prompt":
        prompt[draw(st.integers(0, len(prompt) - 1))] = VOCAB + draw(st.integers(0, 10**6))
    if kind == "bad_stop":
        params.stop_token_ids.append(VOCAB + draw(st.integers(0, 10**6)))
    abort_at = draw(st.none() | st.none() | st.integers(0, 12))
    return Spec(kind, tuple(prompt), params, draw(st.integers(0, 4)), abort_at)


def add(engine: Engine, spec: Spec) -> str:
    prompt = list(spec.prompt)
    if spec.kind in ("bad_prompt", "bad_stop"):
        with pytest.raises(InvalidRequestError) as e:
            engine.make_request(prompt, spec.params)
        assert e.value.param == ("prompt" if spec.kind == "bad_prompt" else "stop_token_ids")
        return poison(engine, prompt, spec.params)
    rid = f"{spec.kind}-{next(_IDS)}"
    return engine.add_request(prompt, spec.params, request_id=rid)


def run_mix(engine: Engine, mix: list[Spec]) -> tuple[list[tuple[str, RequestOutput]], set[str]]:
    """Add, abort and step as the specs say; each spec's request id and final output, and the
    requests that were aborted (by the abort, not by finishing first)."""
    ids: dict[int, str] = {}
    done: dict[str, RequestOutput] = {}
    aborted: set[str] = set()
    for t in itertools.count():
        assert t < 2000, "the engine stopped making progress"
        for i, spec in enumerate(mix):
            if spec.arrival == t:
                ids[i] = add(engine, spec)
            if spec.abort_at == t and i in ids and ids[i] not in done:
                out = engine.abort(ids[i])
                assert out is not None and out.outputs[0].finish_reason == "abort"
                done[ids[i]] = out
                aborted.add(ids[i])
        if t > max(s.arrival for s in mix) and not engine.has_unfinished:
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
    assert set(done) == set(ids.values())
    return [(ids[i], done[ids[i]]) for i in range(len(mix))], aborted


def check_mix(engine: Engine, mix: list[Spec], seen: Counter[str]) -> None:
    errors_before = engine.stats.num_requests_finished.get("error", 0)
    done, aborted = run_mix(engine, mix)
    num_errors = 0
    for spec, (rid, out) in zip(mix, done, strict=True):
        reason = out.outputs[0].finish_reason
        num_errors += reason == "error"
        if rid in aborted:
            seen["aborted"] += 1
            if spec.kind in ("good", "flaky"):
                ref = alone(engine, list(spec.prompt), spec.params).outputs[0].token_ids
                assert ref[: len(out.outputs[0].token_ids)] == out.outputs[0].token_ids
        elif spec.kind in ("good", "flaky"):
            ref = alone(engine, list(spec.prompt), spec.params).outputs[0]
            assert (out.outputs[0].token_ids, reason) == (ref.token_ids, ref.finish_reason), rid
            if spec.params.logprobs is not None:
                logprobs = out.outputs[0].logprobs or []
                assert [lp.token_id for lp in logprobs] == ref.token_ids, rid
        else:
            seen[spec.kind] += 1
            assert reason == "error" and out.error is not None, rid
            assert out.error.startswith("request failed in the engine: "), out.error
    assert engine.stats.num_requests_finished.get("error", 0) == errors_before + num_errors
    assert_idle_and_whole(engine)
    fresh = SamplingParams(temperature=0, max_tokens=3)
    assert run_alone(engine, [1, 2, 3], fresh).outputs[0].token_ids == (
        alone(engine, [1, 2, 3], fresh).outputs[0].token_ids
    )


# Three requests of 42 + 8 tokens in a cache of 6 blocks of 16: two fill it with their prompts,
# and the first to need a fourth block preempts the other.
PREEMPTING_MIX = [
    Spec(
        "good",
        (*PREFIXES[2], *range(200, 210)),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        0,
        None,
    )
    for _ in range(3)
]


def test_random_mixes_of_faults_leave_the_engine_whole(engine: Engine) -> None:
    seen: Counter[str] = Counter()
    batches_before = engine.faults.raised["batch"]  # type: ignore[attr-defined]
    preempting_before = engine.faults.raised["preempting steps"]  # type: ignore[attr-defined]

    @settings(
        max_examples=40,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.lists(specs(), min_size=1, max_size=10))
    @example(PREEMPTING_MIX)  # the drawn mixes preempt or not as the sampled tokens fall
    def mixes(mix: list[Spec]) -> None:
        # at most K - 1 = 2 always-failing requests: three solo failures in a row stop the
        # engine on purpose (tested above)
        faults = [i for i, s in enumerate(mix) if s.kind == "fault"]
        for i in faults[2:]:
            mix[i] = Spec("good", mix[i].prompt, mix[i].params, mix[i].arrival, mix[i].abort_at)
        seen["examples"] += 1
        check_mix(engine, mix, seen)

    mixes()
    raised = engine.faults.raised  # type: ignore[attr-defined]
    seen["batch failures"] = raised["batch"] - batches_before
    seen["preempting steps"] = raised["preempting steps"] - preempting_before
    # the run covered what it is for
    for what in (
        "bad_prompt",
        "bad_stop",
        "fault",
        "aborted",
        "preempting steps",
        "batch failures",
    ):
        assert seen[what] > 0, (what, seen)


# through the AsyncEngine


def test_async_engine_fails_the_poison_stream_only(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # let an out-of-range stop id past validation, as a bug upstream might
    monkeypatch.setattr("kubeinfer.runtime.engine.engine.check_params", lambda *_: None)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    refs = [alone(engine, p, greedy).outputs[0].token_ids for p in ([5, 6, 7], [*range(40, 80)])]
    finished: list[RequestOutput] = []
    aengine = AsyncEngine(engine, on_finished=finished.append)
    aengine.start()  # from here on, only the engine thread steps the engine

    async def good(prompt: list[int]) -> list[int]:
        ids: list[int] = []
        async for out in aengine.generate(prompt, greedy):
            ids += out.outputs[0].new_token_ids
        return ids

    async def failing(prompt: list[int], params: SamplingParams, request_id: str) -> str:
        with pytest.raises(RequestFailedError) as e:
            async for _ in aengine.generate(prompt, params, request_id=request_id):
                pass
        return str(e.value)

    bad_stop = SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[VOCAB])

    async def main() -> list[Any]:
        return await asyncio.gather(
            good([5, 6, 7]),
            failing([1, 2, 3], bad_stop, "poison-async"),
            good(list(range(40, 80))),
            failing([8, 9], greedy, "fault-async"),
            good([9]),
        )

    try:
        results = asyncio.run(main())
        assert [results[0], results[2]] == refs
        assert results[1].startswith("request failed in the engine: InvalidRequestError")
        assert results[3] == "request failed in the engine: IndexError: index out of range in self"
        assert aengine.is_running and aengine.num_unfinished == 0
        assert {o.request_id for o in finished if o.outputs[0].finish_reason == "error"} == {
            "poison-async",
            "fault-async",
        }
    finally:
        aengine.stop()
    assert_idle_and_whole(engine)
