"""The autoscaling decision: a pure function from metric windows and carried state to replicas.

`decide(policy, observation, state) -> Decision` never does I/O and never reads a clock; the
daemon (`autoscale_daemon.py`) and the simulator (`bench/autoscale_sim.py`) both drive it.

Semantics (each one is pinned by `tests/operator/test_autoscaler.py`):

- **Totals over a per-replica target.** For each metric the load is the *total* over the ready
  pods (the sum of per-pod window values); the recommendation is
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
  at most halves the replicas. A fresh state counts the current replicas as a recommendation
  made now, so a restarted daemon never scales down before a full delay has passed.
- **Several metrics: the max.** Each metric gets its own recommendation; the largest wins and
  names the reason.
- **Clamp.** The result is clamped to [minReplicas, maxReplicas] (immediately, whatever the
  rate limits); when the clamp cut the recommendation, `is_limited` says so (ScalingLimited).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kubeinfer.operator.autoscale_types import (
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


def _highest(recs: list[_Recommendation]) -> _Recommendation:
    """The largest recommendation; on a tie, one that names a metric."""
    return max(recs, key=lambda r: (r.replicas, r.metric is not None))


def decide(policy: Policy, obs: Observation, state: ScalerState) -> Decision:
    """The replicas to ask for now, why, and the state for the next tick (see module doc)."""
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
    clamped_rec = min(max(recommended, policy.min_replicas), policy.max_replicas)
    history = _window(state, now, current, policy.scale_down_delay_s) + ((now, clamped_rec),)

    replicas, reason = current, rec.reason
    if recommended > current:
        limit = max(math.ceil(policy.max_scale_up_rate * current - _EPS), current + 1)
        replicas = min(recommended, limit)
        if replicas < recommended:
            reason += f" (step limited to {replicas})"
    elif recommended < current:
        highest = max(n for _, n in history)
        floor = math.ceil(current / policy.max_scale_down_rate - _EPS)
        replicas = min(current, max(highest, floor, recommended))
        if highest >= current:
            reason = (
                f"scale-down to {recommended} delayed: {highest} recommended within the last "
                f"{policy.scale_down_delay_s:g}s ({rec.reason})"
            )
        elif replicas > max(highest, recommended):
            reason += f" (step limited to {replicas})"

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


def _window(
    state: ScalerState, now: float, current: int, delay_s: float
) -> tuple[tuple[float, int], ...]:
    """Recommendations younger than the delay; a fresh state remembers `current` as of now."""
    if not state.recommendations:
        return ((now, current),)
    return tuple((t, n) for t, n in state.recommendations if t > now - delay_s)
