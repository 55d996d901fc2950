"""The autoscaling decision: a pure function from metric windows and carried state to replicas.

`decide(policy, observation, state) -> Decision` never does I/O and never reads a clock; the
daemon (`autoscale_daemon.py`) and the simulator (`bench/autoscale_sim.py`) both drive it.

Semantics (each one is pinned by `tests/operator/test_autoscaler.py`):

- **Totals over a per-replica target.** For each metric the load is the *total* over the ready
  pods (a counter's is the pods' increase over the window's span, a gauge's the sum of the
  per-pod means: `scrape.SampleStore.total`); the recommendation is
  `ceil(total / targetPerReplica)`. Never a per-pod average times a pod count.
- **Capacity on its way.** The current capacity is spec.replicas (ready pods and pods still
  starting): a shortfall already asked for is not asked for again while its pods start.
- **Tolerance.** If `total / (replicas * target)` is within ±`tolerance` (10 %), hold.
- **Missing data is never zero load.** A ready pod without data in a window (scrape failed, too
  few samples) is absent from the total when judging a scale-up, and counted as exactly at
  target when judging a scale-down. With no data at all: hold.
- **Panic mode.** When the panic (short) window asks for at least `panic_threshold` (2x) the
  ready replicas, panic mode starts and lasts until that has not held for a stable window.
  While panicking the recommendation is the larger of both windows' and never below the
  current replicas (the ratchet): scale up at once, never down.
- **Fast up, bounded.** A scale-up is applied at once, to at most `max_scale_up_rate` (2x)
  the current replicas and at least one more. Since the recommendation is absolute (a total
  over a target, with pods on their way already counted), repeated ticks do not compound:
  the cap only bounds how far one reading can move the replicas in one tick.
- **Slow down.** A scale-down only follows recommendations that stayed lower for
  `scale_down_delay_s`: the target is the highest recommendation in that window, and one step
  at most halves the replicas. What the window remembers each tick is the demand's ask: the
  highest stable-window recommendation of the demand metrics, and their panic-window ask
  while panicking (the panic ratchet holds replicas, it does not recommend them). A fresh
  state counts the current replicas as a recommendation made now, so a restarted daemon never
  scales down before a full delay has passed.
- **A backlog is not demand.** `requestsWaiting` (`BACKLOG_METRICS`) counts work that has
  already arrived, not the rate it arrives at. Beside a demand metric (tokens/s, requests
  running, KV usage) its ask scales up like any other and can start panic mode, but the
  scale-down delay does not remember it: once the queue is drained, the replicas asked for it
  go back to what the demand asked for within the delay (after panic ends, at most halving
  per step) instead of serving an empty queue for the whole delay. On backlog metrics alone
  the backlog is the only demand signal and is remembered like any metric.
- **Both windows agree before going down.** A scale-down goes no lower than the panic window
  asks (ready pods without data in it counted at target): the stable window lags a load that
  is rising now, and the last seconds' load is never scaled away.
- **Several metrics: the max.** Each metric gets its own recommendation; the largest wins and
  names the reason.
- **Clamp.** The result is clamped to [minReplicas, maxReplicas] (immediately, whatever the
  rate limits); when the clamp cut the recommendation, `is_limited` says so (ScalingLimited).
- **Zero (minReplicas 0 only; the router's demand, `Observation.router`).** At 0 replicas
  the metrics say nothing (there are no pods): requests held at the router, or requests it
  answered since the last tick, scale to 1 at once (no window, no delay: a client is
  waiting); none, and 0 stays. Above 0 the metrics decide as above, never below 1, until the
  router has seen no request for `scale_to_zero_after_s` (none held, none in flight, its
  request counter unmoved): then 0. A router that could not be read is not idle, and a fresh
  state has just seen a request, so a restarted daemon waits a whole idle period again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kubeinfer.operator.autoscale_types import (
    BACKLOG_METRICS,
    METRIC_LABELS,
    Decision,
    MetricName,
    MetricReading,
    Observation,
    Policy,
    ScalerState,
)

# ceil() of a ratio that is an integer up to float noise (3000 / 1000 * (1 + 1e-16)) stays 3.
_EPS = 1e-9


@dataclass(slots=True, frozen=True)
class _Recommendation:
    replicas: int
    reason: str
    metric: MetricName | None


def format_value(metric: MetricName, value: float) -> str:
    """A metric value for humans: 5,400 tokens/s, 0.82 KV usage, 3.5 requests."""
    if metric == "kvCacheUsage" or abs(value) < 10:
        return f"{value:.3g}"
    return f"{value:,.0f}"


def describe(metric: MetricName, total: float, target: float, word: str) -> str:
    """'generation tokens/s 5,400 over target 1,000 per replica'."""
    label = METRIC_LABELS[metric]
    return (
        f"{label} {format_value(metric, total)} {word} target "
        f"{format_value(metric, target)} per replica"
    )


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPS))


def recommend_stable(
    reading: MetricReading, current: int, num_ready: int, tolerance: float
) -> _Recommendation:
    """One metric's recommendation from its stable window (tolerance, missing-pod rules)."""
    target = reading.target_per_replica
    if num_ready == 0 or reading.num_stable_pods == 0:
        return _Recommendation(current, f"no {METRIC_LABELS[reading.metric]} data", None)
    capacity = max(current, 1) * target
    # Scale-up: only the load we saw (pods without data are absent, never imagined load).
    seen = reading.stable_total
    if seen > capacity * (1 + tolerance) and _ceil(seen / target) > current:
        return _Recommendation(
            _ceil(seen / target), describe(reading.metric, seen, target, "over"), reading.metric
        )
    # Scale-down: pods without data count as exactly at target (never as zero load).
    num_missing = max(num_ready - reading.num_stable_pods, 0)
    assumed = seen + num_missing * target
    if assumed < capacity * (1 - tolerance) and _ceil(assumed / target) < current:
        return _Recommendation(
            _ceil(assumed / target),
            describe(reading.metric, assumed, target, "under"),
            reading.metric,
        )
    return _Recommendation(current, "within tolerance", reading.metric)


def _panic_ask(reading: MetricReading) -> float:
    """Replicas the panic window asks for (unrounded; pods without data are absent)."""
    if reading.num_panic_pods == 0:
        return 0.0
    return reading.panic_total / reading.target_per_replica


def _recent_ask(reading: MetricReading, num_ready: int) -> float:
    """Replicas the panic window's load asks for when judging a scale-down (unrounded): pods
    without data count as exactly at target, as for every scale-down; no data: no ask."""
    if reading.num_panic_pods == 0:
        return 0.0
    num_missing = max(num_ready - reading.num_panic_pods, 0)
    return reading.panic_total / reading.target_per_replica + num_missing


def _demand_ask(obs: Observation, recs: list[_Recommendation], is_panicking: bool) -> int:
    """What the scale-down delay remembers from this tick: the demand metrics' asks (the stable
    window's, and the panic window's while panicking). A backlog metric's ask is left out when
    a demand metric is configured too; on backlog metrics alone, they are the demand signal."""
    if not obs.readings:
        return recs[0].replicas
    pairs = list(zip(obs.readings, recs, strict=True))
    demand = [(r, rec) for r, rec in pairs if r.metric not in BACKLOG_METRICS] or pairs
    asks = [rec.replicas for _, rec in demand]
    if is_panicking:
        asks += [_ceil(_panic_ask(r)) for r, _ in demand]
    return max(asks)


def _highest(recs: list[_Recommendation]) -> _Recommendation:
    """The largest recommendation; on a tie, one that names a metric."""
    return max(recs, key=lambda r: (r.replicas, r.metric is not None))


def decide(policy: Policy, obs: Observation, state: ScalerState) -> Decision:
    """The replicas to ask for now, why, and the state for the next tick (see module doc)."""
    if policy.min_replicas > 0:
        return _decide_on_metrics(policy, obs, state)
    last_request_at, num_requests = _last_request(obs, state)
    decision = _to_or_from_zero(policy, obs, state, last_request_at)
    if decision is None:
        decision = _decide_on_metrics(dataclasses.replace(policy, min_replicas=1), obs, state)
    new_state = dataclasses.replace(
        decision.state, last_request_at=last_request_at, num_router_requests=num_requests
    )
    return dataclasses.replace(decision, state=new_state)


def _last_request(obs: Observation, state: ScalerState) -> tuple[float, float | None]:
    """(when a request was last seen at the router, its request counter now)."""
    router = obs.router
    if router is None or not router.is_complete or state.last_request_at is None:
        # demand that could not be read is never idleness; a fresh state starts the count
        return obs.now, router.num_requests if router is not None else None
    is_moved = router.num_requests != state.num_router_requests
    if router.num_held or router.num_in_flight or is_moved:
        return obs.now, router.num_requests
    return state.last_request_at, router.num_requests


def _zero_decision(replicas: int, reason: str, state: ScalerState) -> Decision:
    return Decision(
        replicas=replicas,
        reason=reason,
        recommended=replicas,
        is_limited=False,
        limited_reason="",
        is_panicking=False,
        metric=None,
        state=state,
    )


def _to_or_from_zero(
    policy: Policy, obs: Observation, state: ScalerState, last_request_at: float
) -> Decision | None:
    """The decision at or to zero replicas (module doc); None: the metrics decide."""
    router = obs.router
    if obs.current_replicas == 0:
        num_held = router.num_held if router is not None else 0
        is_answered = (
            router is not None
            and state.num_router_requests is not None
            and router.num_requests != state.num_router_requests
        )
        if num_held > 0 or is_answered:
            what = f"{num_held} requests held" if num_held else "requests answered"
            return _zero_decision(1, f"from zero: {what} at the router", ScalerState())
        return _zero_decision(0, "at zero: no requests at the router", state)
    idle_s = obs.now - last_request_at
    if idle_s >= policy.scale_to_zero_after_s:
        reason = (
            f"to zero: no requests at the router for {idle_s:.0f}s "
            f"(scaleToZeroAfterSeconds {policy.scale_to_zero_after_s:g})"
        )
        return _zero_decision(0, reason, ScalerState())
    return None


def _decide_on_metrics(policy: Policy, obs: Observation, state: ScalerState) -> Decision:
    """The metrics' decision (every rule of the module doc but the zero one)."""
    current, num_ready, now = obs.current_replicas, obs.num_ready, obs.now
    recs = [recommend_stable(r, current, num_ready, policy.tolerance) for r in obs.readings] or [
        _Recommendation(current, "no metrics", None)
    ]
    rec = _highest(recs)

    # Panic: the short window asks for >= threshold x the ready replicas.
    panic_until = state.panic_until
    panic_reading = max(obs.readings, key=_panic_ask, default=None)
    panic_ask = _panic_ask(panic_reading) if panic_reading is not None else 0.0
    if num_ready > 0 and panic_ask >= policy.panic_threshold * num_ready:
        panic_until = now + policy.stable_window_s
    is_panicking = panic_until is not None and now < panic_until
    if not is_panicking:
        panic_until = None
    if is_panicking and panic_reading is not None:
        if _ceil(panic_ask) > rec.replicas:
            total = panic_reading.panic_total
            rec = _Recommendation(
                _ceil(panic_ask),
                "panic: "
                + describe(panic_reading.metric, total, panic_reading.target_per_replica, "over"),
                panic_reading.metric,
            )
        if rec.replicas < current:
            rec = _Recommendation(current, f"panic: holding {current} (no scale-down)", rec.metric)

    recommended = rec.replicas
    demand_ask = _demand_ask(obs, recs, is_panicking)
    clamped_ask = min(max(demand_ask, policy.min_replicas), policy.max_replicas)
    history = _window(state, now, current, policy.scale_down_delay_s) + ((now, clamped_ask),)

    replicas, reason = current, rec.reason
    if recommended > current:
        limit = max(math.ceil(policy.max_scale_up_rate * current - _EPS), current + 1)
        replicas = min(recommended, limit)
        if replicas < recommended:
            reason += f" (step limited to {replicas})"
    elif recommended < current:
        replicas, reason = _scale_down(policy, obs, rec, history)

    limited_reason = ""
    if recommended > policy.max_replicas:
        limited_reason = f"{recommended} wanted, maxReplicas {policy.max_replicas}"
    elif recommended < policy.min_replicas:
        limited_reason = f"{recommended} wanted, minReplicas {policy.min_replicas}"
    clamped = min(max(replicas, policy.min_replicas), policy.max_replicas)
    if clamped != replicas:
        bound = "maxReplicas" if clamped < replicas else "minReplicas"
        reason = f"{reason} (clamped to {bound} {clamped})"
    return Decision(
        replicas=clamped,
        reason=reason,
        recommended=recommended,
        is_limited=bool(limited_reason),
        limited_reason=limited_reason,
        is_panicking=is_panicking,
        metric=rec.metric,
        state=ScalerState(recommendations=history, panic_until=panic_until),
    )


def _scale_down(
    policy: Policy, obs: Observation, rec: _Recommendation, history: tuple[tuple[float, int], ...]
) -> tuple[int, str]:
    """How far down to go when `rec` is below the current replicas, and why: no lower than the
    highest demand ask within the delay, than half the replicas, than the panic window asks."""
    current, num_ready, recommended = obs.current_replicas, obs.num_ready, rec.replicas
    highest = max(n for _, n in history)
    # Both windows must agree: the load of the last seconds bounds how far down to go, so a
    # load rising now is not averaged away by the stable window that lags it.
    recent_reading = max(obs.readings, key=lambda r: _recent_ask(r, num_ready), default=None)
    recent = 0
    if recent_reading is not None:
        recent = min(_ceil(_recent_ask(recent_reading, num_ready)), current)
    floor = math.ceil(current / policy.max_scale_down_rate - _EPS)
    replicas = min(current, max(highest, floor, recommended, recent))
    reason = rec.reason
    if highest >= current:
        reason = (
            f"scale-down to {recommended} delayed: {highest} recommended within the last "
            f"{policy.scale_down_delay_s:g}s ({rec.reason})"
        )
    elif recent >= current and recent_reading is not None:
        reason = (
            f"scale-down to {recommended} held: the last {policy.panic_window_s:g}s ask for "
            f"{recent} ({_describe_recent(recent_reading, num_ready)})"
        )
    elif replicas > max(highest, recommended):
        if replicas == recent and recent > floor:
            reason += f" (the last {policy.panic_window_s:g}s ask for {recent})"
        else:
            reason += f" (step limited to {replicas})"
    return replicas, reason


def _describe_recent(reading: MetricReading, num_ready: int) -> str:
    """'generation tokens/s 9,500 over target 1,000 per replica', missing pods at target."""
    num_missing = max(num_ready - reading.num_panic_pods, 0)
    total = reading.panic_total + num_missing * reading.target_per_replica
    return describe(reading.metric, total, reading.target_per_replica, "over")


def _window(
    state: ScalerState, now: float, current: int, delay_s: float
) -> tuple[tuple[float, int], ...]:
    """Recommendations younger than the delay; a fresh state remembers `current` as of now."""
    if not state.recommendations:
        return ((now, current),)
    return tuple((t, n) for t, n in state.recommendations if t > now - delay_s)
