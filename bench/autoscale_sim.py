"""Trace-replay autoscaling simulator: our `decide` vs a Kubernetes-HPA-defaults baseline.

Four request traces (step, ramp, diurnal, bursty spikes; fixed seeds) drive a fluid queueing
model of replicas: each ready replica generates at most `--capacity` tokens/s, a new replica
serves `--startup` seconds after it is asked for, requests wait in one FIFO queue in front of
all ready replicas. Both autoscalers read generation tokens/s from the same pipeline: every
pod's `vllm:generation_tokens_total` counter scraped every 5 s into our real `SampleStore`.
Ours is the real `decide` (5 s ticks, CRD default windows) on that metric plus
`additionalMetrics: [{metric: requestsWaiting}]`: each pod's `vllm:num_requests_waiting` gauge
is its share of the queue (queued tokens / mean tokens per request / ready pods), scraped with
the counter and averaged over the windows as the daemon does for gauges. Its target is not
fitted to the traces: the requests a replica at its throughput target serves within the SLO
wait, `--target * --slo-wait / mean tokens per request` (1000 * 2 / 352 = 5.7), so a replica at
target with that queue clears it within the SLO, and the queue metric keeps the same headroom
below capacity as the throughput target does. Throughput read from saturated pods cannot show
the demand beyond them; the queue can. The baseline keeps the single metric (what an HPA on
tokens/s has) and mimics the HPA's defaults on it as a Pods metric with an AverageValue
target: 15 s sync, 10 %
tolerance, a 60 s rate window (rate(...[1m])), missing/unready pods at 0 on the way up and at
target on the way down, scale-up policy max(4 pods, 100 %) per 15 s, 300 s scale-down
stabilization then 100 % per 15 s.

Reported per trace and in total: SLO-violation seconds (seconds whose queue wait exceeds
`--slo-wait`), replica-seconds (every pod asked for, starting or ready), scale events. A PNG
timeline is written; a row goes to bench/RESULTS.md; the last line is
`violation_ratio=<ours/HPA> replica_seconds_ratio=<ours/HPA>`.
Goal: <= 0.5x the baseline's violation seconds at <= 1.1x its replica-seconds.

    python bench/autoscale_sim.py [--capacity 2000 --target 1000 --startup 60 --png PATH]
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kubeinfer.operator.autoscale_types import (
    MetricName,
    Observation,
    PodSample,
    Policy,
    ScalerState,
)
from kubeinfer.operator.autoscaler import decide
from kubeinfer.operator.scrape import SampleStore

RESULTS = Path(__file__).with_name("RESULTS.md")
COUNTER = "vllm:generation_tokens_total"
WAITING = "vllm:num_requests_waiting"
METRIC = "generationTokensPerSecond"
SCRAPE_S = 5
OUTPUT_MIX = ((64, 0.3), (256, 0.5), (1024, 0.2))  # generated tokens per request, weight
MEAN_TOKENS = sum(n * w for n, w in OUTPUT_MIX)  # 352 per request


def step_trace(t: float) -> float:
    return 9000.0 if 600 <= t < 2400 else 1500.0


def ramp_trace(t: float) -> float:
    up = min(max((t - 300) / 1800, 0.0), 1.0)
    down = min(max((t - 2700) / 900, 0.0), 1.0)
    return 1000 + 11_000 * (up - down)


def diurnal_trace(t: float) -> float:
    return 1000 + 7000 * (1 - math.cos(2 * math.pi * t / 3600)) / 2


def bursty_trace(seed: int, duration: int) -> Callable[[float], float]:
    rng = random.Random(seed)
    spikes, t = [], 120.0
    while t < duration:
        t += rng.expovariate(1 / 400)
        spikes.append((t, t + rng.uniform(30, 180), rng.uniform(2, 5)))
    return lambda now: 2000.0 * max([f for s, e, f in spikes if s <= now < e], default=1.0)


def tokens_per_second(demand: Callable[[float], float], duration: int, seed: int) -> list[float]:
    """Poisson request arrivals at demand(t)/mean output tokens per second, with the mix."""
    rng = random.Random(seed)
    lengths, weights = zip(*OUTPUT_MIX, strict=True)
    out = []
    for t in range(duration):
        lam, k, acc = demand(t) / MEAN_TOKENS, 0, rng.expovariate(1.0)
        while acc < lam:  # Poisson count by exponential gaps
            k += 1
            acc += rng.expovariate(1.0)
        out.append(float(sum(rng.choices(lengths, weights, k=k))))
    return out


@dataclass
class Pod:
    name: str
    ready_at: float
    counter: float = 0.0


@dataclass
class Cluster:
    """Replicas, the queue in front of them, and what happened each second."""

    capacity: float
    startup_s: float
    pods: list[Pod] = field(default_factory=list)
    backlog: float = 0.0
    num_created: int = 0
    replicas: list[int] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    num_events: int = 0

    def ready(self, now: float) -> list[Pod]:
        return [p for p in self.pods if p.ready_at <= now]

    def scale_to(self, n: int, now: float, *, initial: bool = False) -> None:
        if n == len(self.pods):
            return
        self.num_events += 0 if initial else 1
        while len(self.pods) < n:
            self.num_created += 1
            ready_at = -1.0 if initial else now + self.startup_s
            self.pods.append(Pod(f"pod-{self.num_created}", ready_at))
        # remove starting pods first, then the newest ready ones
        self.pods.sort(key=lambda p: p.ready_at)
        del self.pods[n:]

    def serve(self, now: float, arrived: float) -> None:
        ready = self.ready(now)
        capacity = len(ready) * self.capacity
        self.backlog += arrived
        served = min(self.backlog, capacity)
        self.backlog -= served
        for p in ready:
            p.counter += served / len(ready)
        self.waits.append(self.backlog / capacity if capacity else math.inf)
        self.replicas.append(len(self.pods))

    def scrape(self, store: SampleStore, now: float) -> None:
        ready = self.ready(now)
        # each pod's share of the queue, in requests (the fluid queue holds tokens)
        waiting = self.backlog / MEAN_TOKENS / max(len(ready), 1)
        store.add(PodSample(p.name, now, {COUNTER: p.counter}, {WAITING: waiting}) for p in ready)
        store.retain([p.name for p in self.pods], now)


class Ours:
    """The real decide() on the real SampleStore, CRD defaults, a tick per scrape, on
    generation tokens/s and (when `waiting_target` is set) requests waiting: the max."""

    interval_s = SCRAPE_S

    def __init__(self, policy: Policy, target: float, waiting_target: float | None) -> None:
        self.policy, self.state = policy, ScalerState()
        self.targets: list[tuple[MetricName, float]] = [(METRIC, target)]
        if waiting_target is not None:
            self.targets.append(("requestsWaiting", waiting_target))
        retention = policy.stable_window_s + 2 * SCRAPE_S
        self.store = SampleStore(retention_s=retention, grace_s=SCRAPE_S / 2)

    def tick(self, cluster: Cluster, now: float) -> int:
        cluster.scrape(self.store, now)
        ready = [p.name for p in cluster.ready(now)]
        readings = tuple(
            self.store.reading(
                metric,
                target,
                ready_pods=ready,
                now=now,
                stable_window_s=self.policy.stable_window_s,
                panic_window_s=self.policy.panic_window_s,
            )
            for metric, target in self.targets
        )
        obs = Observation(now, len(cluster.pods), len(ready), readings)
        d = decide(self.policy, obs, self.state)
        self.state = d.state
        return d.replicas


class HPA:
    """Kubernetes HPA defaults on the same metric (see the module docstring)."""

    interval_s = 15
    tolerance = 0.1
    window_s = 60.0
    down_stabilization_s = 300.0

    def __init__(self, policy: Policy, target: float) -> None:
        self.min, self.max, self.target = policy.min_replicas, policy.max_replicas, target
        self.store = SampleStore(retention_s=self.window_s + 2 * SCRAPE_S, grace_s=SCRAPE_S / 2)
        self.recommendations: list[tuple[float, int]] = []

    def scrape(self, cluster: Cluster, now: float) -> None:
        cluster.scrape(self.store, now)

    def _replicas_from_metrics(self, cluster: Cluster, now: float) -> int:
        """replica_calculator.go's calcPlainMetricReplicas for an AverageValue target."""
        current = len(cluster.pods)
        ready = cluster.ready(now)
        num_unready = current - len(ready)
        metrics, missing = {}, 0
        for p in ready:
            v = self.store.pod_value(p.name, METRIC, now, self.window_s)
            if v is None:
                missing += 1
            else:
                metrics[p.name] = v
        if not metrics:
            return current
        ratio = sum(metrics.values()) / len(metrics) / self.target
        if not (num_unready and ratio > 1.0) and not missing:
            if abs(1.0 - ratio) <= self.tolerance:
                return current
            return math.ceil(ratio * len(metrics))
        values = list(metrics.values())
        values += [self.target if ratio < 1.0 else 0.0] * missing
        if ratio > 1.0:
            values += [0.0] * num_unready
        new_ratio = sum(values) / len(values) / self.target
        if abs(1.0 - new_ratio) <= self.tolerance or (ratio < 1.0) != (new_ratio < 1.0):
            return current
        desired = math.ceil(new_ratio * len(values))
        if (new_ratio < 1.0 and desired > current) or (new_ratio > 1.0 and desired < current):
            return current
        return desired

    def tick(self, cluster: Cluster, now: float) -> int:
        current = len(cluster.pods)
        desired = self._replicas_from_metrics(cluster, now)
        self.recommendations = [
            (t, n) for t, n in self.recommendations if t > now - self.down_stabilization_s
        ]
        # stabilization: scale-up window 0 s, scale-down window 300 s (the max in it)
        down_rec = max([n for _, n in self.recommendations] + [desired])
        self.recommendations.append((now, desired))
        rec = min(max(current, desired), down_rec)
        # policies: up max(4 pods, 100 %) per 15 s; down 100 % per 15 s
        rec = min(rec, max(current + 4, 2 * current))
        return min(max(rec, self.min), self.max)


class Oracle:
    """Reference only: knows the true demand now, asks ceil(demand / target) at once, and keeps
    the same scale-down delay (the highest ask in it). No metric-driven scaler reacts sooner,
    so its violation seconds show what the start-up delay leaves to following demand. It bounds
    reacting, not violations: ours beats it on the step and on bursts, where the queue signal
    asks past the demand (for the backlog too) and panic holds the extra replicas; throughput
    alone, read from saturated pods, trails it on the step (173 violation s against 88)."""

    interval_s = SCRAPE_S

    def __init__(self, policy: Policy, target: float, demand: Callable[[float], float]) -> None:
        self.policy, self.target, self.demand = policy, target, demand
        self.asks: list[tuple[float, int]] = []

    def tick(self, cluster: Cluster, now: float) -> int:
        ask = math.ceil(self.demand(now) / self.target)
        delay = self.policy.scale_down_delay_s
        self.asks = [(t, n) for t, n in self.asks if t > now - delay] + [(now, ask)]
        top = max(n for _, n in self.asks)
        return min(max(top, self.policy.min_replicas), self.policy.max_replicas)


@dataclass
class Outcome:
    violation_s: int
    replica_s: int
    num_events: int
    cluster: Cluster


def replay(
    controller: Ours | HPA | Oracle, arrivals: list[float], args: argparse.Namespace, initial: int
) -> Outcome:
    cluster = Cluster(args.capacity, args.startup)
    cluster.scale_to(initial, 0.0, initial=True)
    for now, arrived in enumerate(arrivals):
        cluster.serve(now, arrived)
        if isinstance(controller, HPA) and now % SCRAPE_S == 0:
            controller.scrape(cluster, now)
        if now % controller.interval_s == 0:
            cluster.scale_to(controller.tick(cluster, now), now)
    violation = sum(1 for w in cluster.waits if w > args.slo_wait)
    return Outcome(violation, sum(cluster.replicas), cluster.num_events, cluster)


def plot(
    path: Path, results: dict[str, tuple[list[float], Outcome, Outcome]], target: float
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.2 * len(results)), squeeze=False)
    for ax, (name, (arrivals, ours, hpa)) in zip(axes[:, 0], results.items(), strict=True):
        smooth = [
            sum(arrivals[max(0, i - 29) : i + 1]) / min(i + 1, 30) for i in range(len(arrivals))
        ]
        ax.plot([v / target for v in smooth], color="0.6", lw=1, label="load / target (30 s mean)")
        ax.plot(ours.cluster.replicas, color="tab:blue", lw=1.5, label="replicas, ours")
        ax.plot(hpa.cluster.replicas, color="tab:orange", lw=1.5, label="replicas, HPA")
        ax.set_ylabel("replicas")
        ax.set_title(f"{name}: violation s ours {ours.violation_s} / HPA {hpa.violation_s}")
        wait = ax.twinx()
        for o, color in ((ours, "tab:blue"), (hpa, "tab:orange")):
            wait.plot([min(w, 60) for w in o.cluster.waits], color=color, lw=0.6, ls=":")
        wait.set_ylabel("queue wait s (dotted)")
        ax.legend(loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--capacity", type=float, default=2000.0, help="tokens/s per replica")
    parser.add_argument("--target", type=float, default=1000.0, help="targetPerReplica")
    parser.add_argument("--startup", type=float, default=60.0, help="s until a new pod serves")
    parser.add_argument("--slo-wait", type=float, default=2.0, help="queue wait SLO, s")
    parser.add_argument(
        "--waiting-target",
        type=float,
        default=None,
        help="ours' requestsWaiting target per replica (default: target * SLO wait / mean "
        "tokens per request; 0: throughput only)",
    )
    parser.add_argument("--max-replicas", type=int, default=16)
    parser.add_argument("--duration", type=int, default=3600)
    parser.add_argument("--png", type=Path, default=Path(".cache/bench/autoscale_sim.png"))
    parser.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args()
    policy = Policy(min_replicas=1, max_replicas=args.max_replicas)
    waiting_target = args.waiting_target
    if waiting_target is None:
        waiting_target = args.target * args.slo_wait / MEAN_TOKENS
    print(f"ours: {METRIC} target {args.target:g}, requestsWaiting target {waiting_target:.3g}")
    traces = {
        "step": step_trace,
        "ramp": ramp_trace,
        "diurnal": diurnal_trace,
        "bursty": bursty_trace(7, args.duration),
    }
    results, oracle_v = {}, 0
    print(f"{'trace':8} {'violation s':>26} {'replica-s':>17} {'scale events':>14}")
    print(
        f"{'':8} {'ours':>8} {'HPA':>8} {'oracle':>8} {'ours':>8} {'HPA':>8} {'ours':>6} {'HPA':>6}"
    )
    for seed, (name, demand) in enumerate(traces.items()):
        arrivals = tokens_per_second(demand, args.duration, seed)
        initial = max(1, math.ceil(demand(0) / args.target))
        ours = replay(Ours(policy, args.target, waiting_target or None), arrivals, args, initial)
        hpa = replay(HPA(policy, args.target), arrivals, args, initial)
        oracle = replay(Oracle(policy, args.target, demand), arrivals, args, initial)
        oracle_v += oracle.violation_s
        results[name] = (arrivals, ours, hpa)
        print(
            f"{name:8} {ours.violation_s:8d} {hpa.violation_s:8d} {oracle.violation_s:8d} "
            f"{ours.replica_s:8d} {hpa.replica_s:8d} {ours.num_events:6d} {hpa.num_events:6d}"
        )
    ours_v = sum(r[1].violation_s for r in results.values())
    hpa_v = sum(r[2].violation_s for r in results.values())
    ours_r = sum(r[1].replica_s for r in results.values())
    hpa_r = sum(r[2].replica_s for r in results.values())
    ours_e = sum(r[1].num_events for r in results.values())
    hpa_e = sum(r[2].num_events for r in results.values())
    print(
        f"{'total':8} {ours_v:8d} {hpa_v:8d} {oracle_v:8d} {ours_r:8d} {hpa_r:8d} {ours_e:6d} "
        f"{hpa_e:6d}"
    )
    print(
        f"reference: a demand oracle (true demand, instant ask, same delay) has {oracle_v} "
        f"violation s ({oracle_v / max(hpa_v, 1):.2f}x HPA)"
    )
    plot(args.png, results, args.target)
    print(f"timeline: {args.png}")
    v_ratio, r_ratio = ours_v / max(hpa_v, 1), ours_r / hpa_r
    if not args.no_results:
        with RESULTS.open("a") as f:
            f.write(
                f"| {dt.date.today()} | autoscale_sim | 4 traces x {args.duration} s, "
                f"{args.capacity:g} tok/s per replica, target {args.target:g}, start-up "
                f"{args.startup:g} s, SLO wait {args.slo_wait:g} s | ours (tokens/s + requests "
                f"waiting, target {waiting_target:.3g}) {ours_v} violation s, "
                f"{ours_r} replica-s, {ours_e} events | HPA defaults {hpa_v} violation s, {hpa_r} "
                f"replica-s, {hpa_e} events | violation ratio {v_ratio:.3f}, replica-seconds "
                f"ratio {r_ratio:.3f} (demand oracle: violation ratio "
                f"{oracle_v / max(hpa_v, 1):.2f}) |\n"
            )
    print(f"violation_ratio={v_ratio:.3f} replica_seconds_ratio={r_ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
