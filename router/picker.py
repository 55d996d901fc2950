"""pick(features, pods) -> Pick | Hold | Reject: which pod serves a request, and why. Pure.

The score, in order:

1. **No pod** (none ready): `Hold` while the hold queue has room (`num_held < max_held`),
   else `Reject`. Pods exist but every one is in `exclude` (each refused a connection for this
   request): `Reject`.
2. **One pod** left: it, reason `only-pod`.
3. **Affinity** (the `x-session-id` header, else the prompt's prefix key): the pods the router
   sent this key to before (`known`, from `affinity.AffinityIndex`, first-served first: where
   its KV blocks are cached), then the others by score (least loaded first), then by the
   number of keys the router sends them (`PodView.num_keys`), then by rendezvous
   (highest-random-weight) order of `blake2b(key, pod name)`. Bounded load (Mirrokni et al.,
   "Consistent Hashing with Bounded Loads"): the first pod in that order whose
   `load + 1 <= ceil(balance_factor * (total load + 1) / number of pods)` and whose KV usage
   is under `kv_saturation` takes it, reason `session` or `prefix`. So a new key goes to the
   least loaded pod (a handful of hot prefixes spread evenly, where hashing alone can give one
   pod half of them), a known key stays with its pod up to `balance_factor` times the mean
   load, then spills to the least loaded other pod, which becomes a known pod of the key too
   (its cache warms), and never pins one overloaded pod. Stale pods stay in the order (a busy
   pod's scrape can time out; moving its keys would throw its cache away) with their in-flight
   load.
4. **Load** (no key, or every pod over its bound or saturated): the lowest
   `load + kv_weight * kv_usage + stale_penalty * is_stale`; ties go by rendezvous order of
   the request id, so idle pods share sequential requests. `load` is the larger of the
   router's own in-flight count and the pod's scraped `num_requests_running +
   num_requests_waiting` (`PodView.load`); `kv_weight` 4 means a full KV cache counts as four
   queued requests.

The decision's reason feeds kubeinfer_router_decisions_total{reason}.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

from kubeinfer.router.routing_types import (
    Decision,
    Hold,
    Pick,
    PickerConfig,
    PodView,
    Reason,
    Reject,
    RequestFeatures,
)


def rendezvous_order(key: bytes, names: Iterable[str]) -> list[str]:
    """`names` by descending blake2b(key, name): a stable per-key preference order (Python's
    own hash is salted per process, so it would differ between router replicas)."""

    def weight(name: str) -> bytes:
        return hashlib.blake2b(key + b"\x00" + name.encode(), digest_size=8).digest()

    return sorted(names, key=weight, reverse=True)


def bounded_capacity(pods: Sequence[PodView], balance_factor: float) -> float:
    """The most load (this request included) one pod may carry for affinity to hold."""
    total = sum(p.load for p in pods) + 1
    return math.ceil(balance_factor * total / len(pods))


def score(pod: PodView, config: PickerConfig) -> float:
    """Lower is better: load, KV pressure and staleness in units of queued requests."""
    kv = pod.kv_usage if pod.kv_usage is not None else 0.0
    return pod.load + config.kv_weight * kv + (config.stale_penalty if pod.is_stale else 0.0)


def _affine(
    key: bytes, pods: Sequence[PodView], config: PickerConfig, known: Sequence[str]
) -> PodView | None:
    capacity = bounded_capacity(pods, config.balance_factor)
    by_name = {p.name: p for p in pods}
    first = [by_name[name] for name in dict.fromkeys(known) if name in by_name]
    rank = {name: i for i, name in enumerate(rendezvous_order(key, by_name))}
    rest = sorted(
        (p for p in pods if p.name not in known),
        key=lambda p: (score(p, config), p.num_keys, rank[p.name]),
    )
    for pod in first + rest:
        saturated = pod.kv_usage is not None and pod.kv_usage >= config.kv_saturation
        if pod.load + 1 <= capacity and not saturated:
            return pod
    return None


def _least_loaded(features: RequestFeatures, pods: Sequence[PodView], config: PickerConfig) -> str:
    order = rendezvous_order(features.request_id.encode(), (p.name for p in pods))
    rank = {name: i for i, name in enumerate(order)}
    return min(pods, key=lambda p: (score(p, config), rank[p.name])).name


def pick(
    features: RequestFeatures,
    pods: Sequence[PodView],
    *,
    num_held: int = 0,
    max_held: int = 0,
    exclude: frozenset[str] = frozenset(),
    config: PickerConfig | None = None,
    known: Sequence[str] = (),
) -> Decision:
    """The pod for this request (see the module docstring for the score). `known`: the pods
    this request's affinity key (`affinity_key`) was sent to before, first-served first."""
    config = config or PickerConfig()
    if not pods:
        if num_held < max_held:
            return Hold()
        return Reject(f"no ready pod and {num_held} requests already held (max {max_held})")
    candidates = [p for p in pods if p.name not in exclude]
    if not candidates:
        return Reject(f"no pod answered ({len(exclude)} tried)")
    if len(candidates) == 1:
        return Pick(candidates[0].name, "only-pod")
    key, reason = affinity_key(features)
    if key is not None and reason is not None:
        chosen = _affine(key, candidates, config, known)
        if chosen is not None:
            return Pick(chosen.name, reason)
    return Pick(_least_loaded(features, candidates, config), "load")


def affinity_key(features: RequestFeatures) -> tuple[bytes | None, Reason | None]:
    """The key affinity goes by (the session, else the prefix) and its reason; (None, None):
    none, load decides."""
    if features.session_id:
        return b"session\x00" + features.session_id.encode(), "session"
    if features.prefix_key is not None:
        return b"prefix\x00" + features.prefix_key, "prefix"
    return None, None
