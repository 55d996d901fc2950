"""`decide` at and to zero replicas (minReplicas 0), from the router's demand. Pure: no clock."""

from __future__ import annotations

from kubeinfer.operator.autoscale_types import (
    MetricReading,
    Observation,
    Policy,
    RouterDemand,
    ScalerState,
)
from kubeinfer.operator.autoscaler import decide

ZERO = Policy(min_replicas=0, max_replicas=4, scale_to_zero_after_s=60.0)
IDLE = RouterDemand(num_held=0, num_in_flight=0, num_requests=10.0, is_complete=True)


def reading(total: float) -> MetricReading:
    return MetricReading("generationTokensPerSecond", 1000.0, total, 1, total, 1)


def obs(now: float, current: int, router: RouterDemand | None, load: float = 0.0) -> Observation:
    num_ready = current
    return Observation(now, current, num_ready, (reading(load),) if current else (), router)


def run(
    steps: list[tuple[float, RouterDemand | None]],
    *,
    current: int,
    policy: Policy = ZERO,
    load: float = 0.0,
) -> list[int]:
    """Tick through (time, router demand); replicas follow the decisions (pods ready at once)."""
    state, out = ScalerState(), []
    for now, router in steps:
        d = decide(policy, obs(now, current, router, load), state)
        state, current = d.state, d.replicas
        out.append(current)
    return out


def test_held_requests_at_zero_scale_to_one_at_once() -> None:
    held = RouterDemand(num_held=5, num_in_flight=0, num_requests=10.0, is_complete=True)
    d = decide(ZERO, obs(0.0, 0, held), ScalerState())
    assert d.replicas == 1 and "5 requests held" in d.reason


def test_requests_answered_at_zero_scale_to_one() -> None:
    """A router holding nothing (maxHeldRequests 0, or holds that timed out) still answered
    requests since the last tick: that is demand."""
    moved = RouterDemand(0, 0, 12.0, True)
    assert run([(0.0, IDLE), (2.0, moved)], current=0) == [0, 1]


def test_no_demand_at_zero_stays_at_zero() -> None:
    assert run([(0.0, IDLE), (2.0, IDLE), (4.0, None)], current=0) == [0, 0, 0]


def test_idle_for_the_whole_period_scales_to_zero_and_not_before() -> None:
    steps = [(float(t), IDLE) for t in range(0, 70, 5)]
    out = run(steps, current=1)
    assert out[:-2] == [1] * (len(out) - 2)  # t = 0 starts the count (a fresh state)
    assert out[-2:] == [0, 0]  # t = 60: 60 s without a request
    d = decide(ZERO, obs(60.0, 1, IDLE), ScalerState(last_request_at=0.0, num_router_requests=10))
    assert d.replicas == 0 and "60s" in d.reason and d.state.last_request_at == 0.0


def test_each_kind_of_request_restarts_the_idle_period() -> None:
    for busy in (
        RouterDemand(1, 0, 10.0, True),  # held (a pod restarting)
        RouterDemand(0, 1, 10.0, True),  # in flight
        RouterDemand(0, 0, 11.0, True),  # came and went between two ticks
    ):
        after = RouterDemand(0, 0, busy.num_requests, True)
        steps = [(0.0, IDLE), (50.0, busy), (100.0, after), (109.0, after), (110.0, after)]
        out = run(steps, current=1)
        assert out == [1, 1, 1, 1, 0], busy


def test_demand_that_cannot_be_read_is_never_idleness() -> None:
    partial = RouterDemand(0, 0, 10.0, is_complete=False)  # a router pod's scrape failed
    steps = [(0.0, IDLE), (30.0, partial), (70.0, IDLE), (89.0, IDLE), (90.0, IDLE)]
    assert run(steps, current=1) == [1, 1, 1, 1, 0]
    assert run([(0.0, IDLE), (30.0, None), (70.0, None), (200.0, None)], current=1) == [1] * 4


def test_above_zero_the_metrics_decide_but_never_below_one() -> None:
    busy = RouterDemand(0, 3, 10.0, True)
    # load of 3 replicas: up like with minReplicas 1
    assert run([(0.0, busy), (5.0, busy)], current=1, load=3000.0)[-1] == 3
    # no load, but requests in flight: the metrics may go down to 1, never to 0
    out = run([(float(t), busy) for t in range(0, 400, 5)], current=2, load=0.0)
    assert min(out) == 1 and out[-1] == 1


def test_min_replicas_above_zero_never_reaches_zero() -> None:
    one = Policy(min_replicas=1, max_replicas=4, scale_to_zero_after_s=0.0)
    assert run([(float(t), IDLE) for t in range(0, 100, 10)], current=1, policy=one) == [1] * 10
