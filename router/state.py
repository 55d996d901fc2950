"""RouterState: the router's current view (pods, their last scrape, in-flight counts, the hold
queue) and `route()`, which asks the pure picker and waits in the hold queue when told to.

The view is replaced wholesale by the discovery loop (`set_backends`) and the scrape loop
(`apply_samples`); routing reads it. Everything runs on one event loop, so a pick and the
in-flight increment that follows it see the same view.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from kubeinfer.operator.autoscale_types import PodSample
from kubeinfer.router.affinity import AffinityIndex
from kubeinfer.router.discovery import Backend
from kubeinfer.router.hold import HoldQueue
from kubeinfer.router.metrics import RouterMetrics
from kubeinfer.router.picker import affinity_key, pick
from kubeinfer.router.routing_types import Hold, Pick, PodView, Reject, RequestFeatures
from kubeinfer.router.settings import RouterSettings

logger = logging.getLogger(__name__)

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"


@dataclass(slots=True)
class PodState:
    backend: Backend
    num_in_flight: int = 0
    sample: PodSample | None = None
    """The last good scrape; None: stale (never scraped, or the last one failed)."""

    def view(self, num_keys: int = 0) -> PodView:
        g = self.sample.gauges if self.sample is not None else None
        return PodView(
            self.backend.name,
            self.num_in_flight,
            num_waiting=None if g is None else g.get(WAITING, 0.0),
            num_running=None if g is None else g.get(RUNNING, 0.0),
            kv_usage=None if g is None else g.get(KV_USAGE),
            num_keys=num_keys,
        )


class RouterState:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.picker_config = settings.picker_config()
        self.pods: dict[str, PodState] = {}
        self.hold = HoldQueue()
        self.affinity = AffinityIndex(settings.affinity_keys)
        self.metrics = RouterMetrics(self.views, lambda: len(self.hold))
        self.has_synced = False
        """True once discovery answered: the router is ready (with or without pods)."""

    def views(self) -> list[PodView]:
        return [p.view(self.affinity.num_keys(name)) for name, p in self.pods.items()]

    def set_backends(self, backends: Iterable[Backend]) -> None:
        """The routable pods are now exactly `backends`; held requests go when there are any."""
        current = {b.name: b for b in backends}
        gone = set()
        for name in list(self.pods):
            if name not in current or current[name].url != self.pods[name].backend.url:
                logger.info("pod %s left the routable set", name)
                del self.pods[name]
                gone.add(name)
        self.affinity.forget_pods(gone)
        for name, backend in current.items():
            if name not in self.pods:
                logger.info("pod %s is routable at %s", name, backend.url)
                self.pods[name] = PodState(backend)
        self.has_synced = True
        if self.pods and len(self.hold):
            logger.info("releasing %d held requests", self.hold.release_all())

    def apply_samples(self, samples: Iterable[PodSample]) -> None:
        for sample in samples:
            pod = self.pods.get(sample.pod)
            if pod is not None:
                pod.sample = sample if sample.is_ok else None

    def mark_stale(self, name: str) -> None:
        """The pod refused a connection: its last scrape no longer tells its load."""
        if (pod := self.pods.get(name)) is not None:
            pod.sample = None

    async def route(
        self, features: RequestFeatures, exclude: frozenset[str] = frozenset()
    ) -> Pick | Reject:
        """A pod for this request, waiting in the hold queue while none is ready."""
        s = self.settings
        arrived = time.monotonic()
        was_held = False
        key, _ = affinity_key(features)
        try:
            while True:
                decision = pick(
                    features,
                    self.views(),
                    num_held=len(self.hold),
                    max_held=s.max_held_requests,
                    exclude=exclude,
                    config=self.picker_config,
                    known=self.affinity.pods(key) if key is not None else (),
                )
                if not isinstance(decision, Hold):
                    break
                was_held = True
                remaining = s.max_hold_s - (time.monotonic() - arrived)
                if remaining <= 0 or not await self.hold.wait(remaining):
                    decision = Reject(f"no ready pod within {s.max_hold_s:g}s")
                    break
        finally:  # the client may leave while held: its wait counts too
            if was_held:
                self.metrics.hold_seconds.observe(time.monotonic() - arrived)
        if isinstance(decision, Pick):
            self.metrics.observe_decision(decision.reason)
            if key is not None:
                self.affinity.record(key, decision.pod)
        return decision
