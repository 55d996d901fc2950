"""`decide` against load scenarios: a table of traces through a tiny replica model, then edges.

The driver ticks every 5 s; pods become ready `startup_s` after they are asked for; the load is
a total (tokens/s) spread evenly over the ready pods, and each window's reading is the mean of
the load over that window, over the ready pods that have data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from kubeinfer.operator.autoscale_types import MetricReading, Observation, Policy, ScalerState
from kubeinfer.operator.autoscaler import decide

TARGET = 1000.0
POLICY = Policy(min_replicas=1, max_replicas=10)
Load = Callable[[float], float]


@dataclass
class Tick:
    time: float
    replicas: int
    num_ready: int
    load: float
    is_panicking: bool
    is_limited: bool
    reason: str


@dataclass
class Run:
    initial: int
    ticks: list[Tick] = field(default_factory=list)

    @property
    def replicas(self) -> list[int]:
        return [t.replicas for t in self.ticks]

    def changes(self) -> list[tuple[float, int, int]]:
        out, prev = [], self.initial
        for t in self.ticks:
            if t.replicas != prev:
                out.append((t.time, prev, t.replicas))
            prev = t.replicas
        return out

    def at(self, time: float) -> Tick:
        return next(t for t in self.ticks if t.time >= time)


def simulate(
    load: Load,
    *,
    duration: float,
    replicas: int = 1,
    startup_s: float = 30.0,
    interval_s: float = 5.0,
    capacity: float = 2 * TARGET,
    policy: Policy = POLICY,
    num_without_data: Callable[[float], int] = lambda t: 0,
) -> Run:
    """Pods serve at most `capacity` each; the windows see what was served, per second."""
    ready_at = [-1.0] * replicas  # the first pods are ready from the start
    state, run = ScalerState(), Run(replicas)
    served: list[float] = []
    for now in range(int(duration) + 1):
        num_ready = sum(1 for r in ready_at if r <= now)
        served.append(min(load(now), num_ready * capacity))
        if now % interval_s:
            continue
        num_data = max(num_ready - num_without_data(now), 0)
        share = num_data / num_ready if num_ready else 0.0

        def mean(window: float, share: float = share) -> float:
            points = served[-int(window) :]
            return sum(points) / len(points) * share

        reading = MetricReading(
            "generationTokensPerSecond",
            TARGET,
            stable_total=mean(policy.stable_window_s),
            num_stable_pods=num_data,
            panic_total=mean(policy.panic_window_s),
            num_panic_pods=num_data,
        )
        d = decide(policy, Observation(now, len(ready_at), num_ready, (reading,)), state)
        state = d.state
        if d.replicas > len(ready_at):
            ready_at += [now + startup_s] * (d.replicas - len(ready_at))
        else:
            ready_at = sorted(ready_at)[: d.replicas]
        run.ticks.append(
            Tick(now, d.replicas, num_ready, load(now), d.is_panicking, d.is_limited, d.reason)
        )
    return run


def const(v: float) -> Load:
    return lambda t: v


def step(before: float, after: float, at: float, until: float = math.inf) -> Load:
    return lambda t: after if at <= t < until else before


def check_steady(run: Run) -> None:
    assert set(run.replicas) == {3}, run.changes()


def check_step_up(run: Run) -> None:
    first = run.changes()[0]
    assert first[0] <= 110, "a 5x step is seen by the panic window within two ticks"
    assert run.at(100 + 2 * 30 + 15).replicas == 5, run.changes()
    assert max(run.replicas) == 5


def check_spike(run: Run) -> None:
    ups = [c for c in run.changes() if c[2] > c[1]]
    downs = [c for c in run.changes() if c[2] < c[1]]
    assert ups and ups[0][0] <= 210, "panic: up within two ticks of the spike"
    assert downs and downs[0][0] >= 230 + 300, "down only after the scale-down delay"
    assert run.ticks[-1].replicas == 1
    assert max(run.replicas) <= 6


def check_ramp(run: Run) -> None:
    reps = run.replicas
    assert all(b >= a for a, b in zip(reps, reps[1:], strict=False)), run.changes()
    assert reps[-1] == 4
    for t in run.ticks:  # never more than one replica behind the ramp (after start-up)
        assert t.replicas >= math.ceil(t.load / TARGET) - 1, (t, run.changes())


def check_oscillating(run: Run) -> None:
    after_warmup = [c for c in run.changes() if c[0] > 60]
    assert len(run.changes()) <= 3, run.changes()
    assert all(c[2] > c[1] for c in after_warmup), f"flapped: {after_warmup}"


def check_failed_scrapes(run: Run) -> None:
    assert min(run.replicas) == 3, run.changes()


def check_pending(run: Run) -> None:
    # 1 -> 2 once while the new pod starts (120 s), not 2 -> 3 -> 4 for the same shortfall.
    assert run.changes() == [(0.0, 1, 2)], run.changes()


def check_max_clamp(run: Run) -> None:
    assert max(run.replicas) == 4
    assert run.ticks[-1].is_limited


def check_min_clamp(run: Run) -> None:
    assert set(run.replicas) == {2}
    assert run.ticks[-1].is_limited


def check_panic_ratchet(run: Run) -> None:
    panicking = [t for t in run.ticks if t.is_panicking]
    assert panicking and panicking[0].time <= 105, "saturated pods (2x target) panic at once"
    reps = [t.replicas for t in panicking]
    assert all(b >= a for a, b in zip(reps, reps[1:], strict=False)), "no scale-down in panic"
    assert max(reps) >= 6
    # the load ends at 180: panic lasts one stable window after it last held, then ends, and
    # only then (the scale-down delay here is 10 s) do replicas come down
    end = panicking[-1].time
    assert 180 <= end <= 180 + 60 + 5
    downs = [c for c in run.changes() if c[2] < c[1]]
    assert downs and downs[0][0] > end, (downs, end)


# name, load, simulate kwargs, check
CASES: list[tuple[str, Load, dict, Callable[[Run], None]]] = [
    ("steady", const(2500), dict(duration=900, replicas=3), check_steady),
    ("step up", step(1000, 5000, at=100), dict(duration=400), check_step_up),
    ("spike", step(800, 5500, at=200, until=230), dict(duration=1000), check_spike),
    ("slow ramp", lambda t: 500 + 3 * min(t, 1100), dict(duration=1300), check_ramp),
    (
        "oscillating",
        lambda t: 2000 + 1200 * math.sin(2 * math.pi * t / 120),
        dict(duration=1500, replicas=2),
        check_oscillating,
    ),
    (
        "failed scrapes under load",
        const(2800),
        dict(duration=900, replicas=3, num_without_data=lambda t: 0 if t < 100 else 2),
        check_failed_scrapes,
    ),
    (
        "all scrapes failing",
        const(2800),
        dict(duration=900, replicas=3, num_without_data=lambda t: 0 if t < 100 else 3),
        check_failed_scrapes,
    ),
    ("pending pods", const(2000), dict(duration=100, startup_s=120), check_pending),
    (
        "max clamp",
        const(20_000),
        dict(duration=300, policy=Policy(min_replicas=1, max_replicas=4)),
        check_max_clamp,
    ),
    (
        "min clamp",
        const(0),
        dict(duration=700, replicas=2, policy=Policy(min_replicas=2, max_replicas=4)),
        check_min_clamp,
    ),
    (
        "panic ratchet",
        step(1000, 8000, at=100, until=180),
        dict(duration=500, policy=Policy(max_replicas=10, scale_down_delay_s=10)),
        check_panic_ratchet,
    ),
]


@pytest.mark.parametrize(
    ("load", "kwargs", "check"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_scenario(load: Load, kwargs: dict, check: Callable[[Run], None]) -> None:
    check(simulate(load, **kwargs))


def _reading(total: float, num_pods: int, panic: float | None = None) -> MetricReading:
    p = total if panic is None else panic
    return MetricReading("generationTokensPerSecond", TARGET, total, num_pods, p, num_pods)


def _once(current: int, ready: int, *readings: MetricReading, state: ScalerState | None = None):
    state = state or ScalerState(recommendations=((-1000.0, 1),))  # delay already served
    return decide(POLICY, Observation(0.0, current, ready, readings), state)


@pytest.mark.parametrize(
    ("total", "num_data", "current", "expected"),
    [
        (1050, 1, 1, 1),  # +5 %: within tolerance
        (9200, 8, 8, 10),  # +15 %: ceil(9.2)
        (0, 1, 4, 3),  # 3 of 4 pods without data count at target (3,000), not as zero load
        (0, 0, 4, 4),  # no data at all: hold
        (5400, 1, 1, 2),  # 5.4x on one pod: +1 at least, 2x at most
        (900, 4, 4, 2),  # one step at most halves
    ],
)
def test_single_decisions(total: float, num_data: int, current: int, expected: int) -> None:
    d = _once(current, current, _reading(total, num_data, panic=0))
    assert d.replicas == expected, d


def test_several_metrics_take_the_max() -> None:
    low = _reading(1000, 2)
    high = MetricReading("requestsWaiting", 4.0, 20.0, 2, 0.0, 2)
    d = _once(2, 2, low, high)
    assert d.replicas == 4 and d.metric == "requestsWaiting", d
    assert "requests waiting 20 over target 4 per replica" in d.reason


def test_reason_reads_like_the_event() -> None:
    d = _once(1, 1, _reading(5400, 1, panic=0))
    assert d.reason.startswith("generation tokens/s 5,400 over target 1,000 per replica"), d


def test_fresh_state_waits_a_full_delay_before_scaling_down() -> None:
    obs = Observation(0.0, 4, 4, (_reading(500, 4),))
    d = decide(POLICY, obs, ScalerState())
    assert d.replicas == 4 and "delayed" in d.reason
    later = decide(POLICY, Observation(301.0, 4, 4, (_reading(500, 4),)), d.state)
    assert later.replicas == 2


def test_one_tick_at_most_doubles_and_pods_on_their_way_count() -> None:
    state = ScalerState(recommendations=((-1000.0, 1),))
    obs = Observation(0.0, 2, 1, (_reading(10_000, 1, panic=0),))
    d = decide(POLICY, obs, state)
    assert d.replicas == 4 and "step limited to 4" in d.reason, d
    # the same shortfall, seen again while those pods start, asks for nothing beyond it
    again = decide(POLICY, Observation(5.0, 10, 1, (_reading(10_000, 1, panic=0),)), d.state)
    assert again.replicas == 10


def _waiting(total: float, num_pods: int, target: float = 5.0) -> MetricReading:
    return MetricReading("requestsWaiting", target, total, num_pods, total, num_pods)


def test_a_growing_queue_scales_past_what_saturated_throughput_asks() -> None:
    """Saturated pods show their capacity, not the demand: 2 ready pods at 2,000 tok/s each
    ask for 4 while a 9,000 tok/s demand waits; pods on their way stop throughput asking more.
    The queue keeps growing while they start and asks past that."""
    policy = Policy(min_replicas=1, max_replicas=10)

    def run(with_queue: bool) -> list[int]:
        state, current, out = ScalerState(), 2, []
        for now in range(0, 35, 5):
            readings = [_reading(4000, 2)]
            if with_queue:
                readings.append(_waiting(4.0 * now, 2))  # 4 more requests/s, target 5
            d = decide(policy, Observation(float(now), current, 2, tuple(readings)), state)
            state, current = d.state, d.replicas
            out.append(current)
        return out

    throughput_only, both = run(False), run(True)
    assert throughput_only[-1] == 4, throughput_only
    assert both[-1] > 4 and both == sorted(both), both
    assert both[:2] == throughput_only[:2], "an empty queue changes nothing"


def test_the_queue_asks_when_throughput_holds() -> None:
    # 4 pods at 1,050 tok/s (within tolerance of 1,000) yet 30 requests waiting (target 5)
    alone = _once(4, 4, _reading(4200, 4))
    d = _once(4, 4, _reading(4200, 4), _waiting(30, 4))
    assert alone.replicas == 4 and d.replicas == 6 and d.metric == "requestsWaiting", d
    assert "requests waiting 30 over target 5 per replica" in d.reason


def test_an_idle_queue_does_not_block_scale_down() -> None:
    alone = _once(4, 4, _reading(1000, 4))
    d = _once(4, 4, _reading(1000, 4), _waiting(0, 4))
    assert alone.replicas == d.replicas == 2, d  # one step at most halves
    assert d.metric == "generationTokensPerSecond" and "under target" in d.reason, d
    # a small queue that one replica carries does not hold the others either
    assert _once(4, 4, _reading(1000, 4), _waiting(3, 4)).replicas == 2


def _both(stable: float, panic: float, num_pods: int, num_panic: int | None = None):
    n = num_pods if num_panic is None else num_panic
    return MetricReading("generationTokensPerSecond", TARGET, stable, num_pods, panic, n)


@pytest.mark.parametrize(
    ("reading", "current", "expected", "word"),
    [
        (_both(1000, 1000, 4), 4, 2, "under"),  # both windows low: halve
        (_both(1000, 3500, 4), 4, 4, "held"),  # the last 6 s ask for 4: no scale-down
        (_both(1000, 2500, 4), 4, 3, "ask for 3"),  # ... for 3: down to 3, not 2
        (_both(2000, 5500, 8), 8, 6, "ask for 6"),
        (_both(1000, 1000, 4, num_panic=2), 4, 3, "ask for 3"),  # 2 pods without data at target
        (_both(1000, 0, 4, num_panic=0), 4, 2, "under"),  # no panic data: no floor from it
    ],
)
def test_scale_down_goes_no_lower_than_the_panic_window_asks(
    reading: MetricReading, current: int, expected: int, word: str
) -> None:
    d = _once(current, current, reading)
    assert d.replicas == expected and word in d.reason, d


def _remembered(d) -> int:
    return d.state.recommendations[-1][1]


@pytest.mark.parametrize(
    ("readings", "current", "replicas", "remembered"),
    [
        # a queue beside tokens/s scales up, but the delay remembers what tokens/s asked
        ((_reading(4000, 4), _waiting(50, 4)), 4, 8, 4),
        ((_reading(6000, 4, panic=0), _waiting(50, 4)), 4, 8, 6),
        # on the queue alone, the queue is the demand and is remembered
        ((_waiting(50, 4),), 4, 8, 10),
        # no queue: the recommendation itself
        ((_reading(6000, 4, panic=0),), 4, 6, 6),
        # panicking on tokens/s: the panic window's ask is remembered (clamped to max 10)
        ((_reading(4000, 4, panic=12_000), _waiting(50, 4)), 4, 8, 10),
    ],
)
def test_the_delay_remembers_the_demand_not_the_backlog(
    readings: tuple[MetricReading, ...], current: int, replicas: int, remembered: int
) -> None:
    d = _once(current, current, *readings)
    assert (d.replicas, _remembered(d)) == (replicas, remembered), d


def test_replicas_asked_for_a_drained_backlog_are_not_held_for_the_delay() -> None:
    """A burst queues 60 requests in front of 2 pods (target 5 each) for 30 s: the queue asks
    for 12 (10 at most). Once it is drained, tokens/s asks for 3; with the queue beside tokens/s
    the replicas come down when panic ends, to the highest tokens/s ask within the delay (4, at
    most halving per step), not after the 300 s delay; scaled on the queue alone they are held
    for the delay as before."""
    policy = Policy(min_replicas=1, max_replicas=10)

    def run(with_tokens: bool) -> list[int]:
        state, current, out = ScalerState(((-1000.0, 2),)), 2, []
        for now in range(0, 400, 5):
            queue = 60.0 if now < 30 else 0.0
            readings = [_waiting(queue, current)]
            if with_tokens:
                readings.append(_reading(4000.0 if now < 30 else 2500.0, current))
            d = decide(policy, Observation(float(now), current, current, tuple(readings)), state)
            state, current = d.state, d.replicas
            out.append(current)
        return out

    both, queue_only = run(True), run(False)
    assert max(both) == max(queue_only) == 10, (both, queue_only)
    # panic (12 asked of 4 ready at t=5) lasts one stable window (to t=65)
    assert set(both[: 60 // 5]) <= {4, 8, 10} and both[60 // 5] == 10, both
    assert (both[65 // 5], both[70 // 5], both[300 // 5], both[-1]) == (5, 4, 4, 3), both
    assert queue_only[320 // 5] == 10 and queue_only[-1] < 10, queue_only
