"""The pure picker: scores, bounded load, affinity, sessions, no ready pod, stale pods."""

from __future__ import annotations

import asyncio
import collections
import dataclasses

import pytest

from kubeinfer.router.affinity import AffinityIndex
from kubeinfer.router.discovery import Backend
from kubeinfer.router.picker import affinity_key, bounded_capacity, pick, rendezvous_order, score
from kubeinfer.router.routing_types import (
    Hold,
    Pick,
    PickerConfig,
    PodView,
    Reject,
    RequestFeatures,
)
from kubeinfer.router.settings import RouterSettings
from kubeinfer.router.state import RouterState

PODS = [PodView(f"pod-{i}", 0, 0.0, 0.0, 0.0) for i in range(4)]


def prefix(n: int) -> RequestFeatures:
    return RequestFeatures(prefix_key=f"prefix-{n}".encode(), request_id=f"r{n}")


def test_no_pod_holds_while_the_queue_has_room_then_rejects() -> None:
    assert pick(prefix(0), [], num_held=0, max_held=2) == Hold()
    assert pick(prefix(0), [], num_held=1, max_held=2) == Hold()
    decision = pick(prefix(0), [], num_held=2, max_held=2)
    assert isinstance(decision, Reject) and "2 requests already held" in decision.why
    assert isinstance(pick(prefix(0), [], max_held=0), Reject)  # holding off


def test_one_pod_is_the_only_pod_and_every_pod_excluded_rejects() -> None:
    assert pick(prefix(0), PODS[:1]) == Pick("pod-0", "only-pod")
    assert pick(prefix(0), PODS[:2], exclude=frozenset({"pod-1"})) == Pick("pod-0", "only-pod")
    decision = pick(prefix(0), PODS[:2], exclude=frozenset({"pod-0", "pod-1"}))
    assert isinstance(decision, Reject) and "no pod answered" in decision.why


def test_a_prefix_always_lands_on_its_pod_while_load_is_even() -> None:
    first = pick(prefix(7), PODS)
    assert isinstance(first, Pick) and first.reason == "prefix"
    for i in range(20):  # another request id, same prefix
        again = pick(RequestFeatures(b"prefix-7", request_id=f"other-{i}"), PODS)
        assert again == first


def test_prefixes_spread_over_pods() -> None:
    chosen = collections.Counter(
        d.pod for d in (pick(prefix(n), PODS) for n in range(400)) if isinstance(d, Pick)
    )
    assert set(chosen) == {p.name for p in PODS}
    assert min(chosen.values()) > 60  # 100 each on average


def test_the_order_survives_a_pod_leaving() -> None:
    """Rendezvous hashing: removing a pod moves only the keys it held."""
    before = {n: pick(prefix(n), PODS) for n in range(200)}
    after = {n: pick(prefix(n), PODS[:3]) for n in range(200)}
    moved = [n for n in before if before[n] != after[n]]
    assert all(before[n].pod == "pod-3" for n in moved)  # type: ignore[union-attr]
    assert rendezvous_order(b"k", ["a", "b", "c"]) == rendezvous_order(b"k", ["c", "a", "b"])


def test_bounded_load_spills_a_hot_prefix_to_its_second_pod_and_no_further() -> None:
    key = prefix(3)
    owner, second = rendezvous_order(b"prefix\x00" + key.prefix_key, [p.name for p in PODS])[:2]  # type: ignore[operator]
    views = {p.name: p for p in PODS}
    placed = []
    for _ in range(12):  # a burst of one prefix: in-flight counts rise as it is placed
        decision = pick(key, list(views.values()))
        assert isinstance(decision, Pick)
        placed.append(decision.pod)
        v = views[decision.pod]
        views[decision.pod] = PodView(v.name, v.num_in_flight + 1, 0.0, 0.0, 0.0)
    counts = collections.Counter(placed)
    # capacity = ceil(1.25 * (load + 1) / 4): the owner leads and never runs far ahead
    assert counts[owner] >= counts[second] >= 1
    assert max(counts.values()) <= bounded_capacity(list(views.values()), 1.25)
    assert placed[0] == owner and placed[1] == second


def test_a_saturated_kv_cache_is_skipped_by_affinity() -> None:
    key = prefix(5)
    owner = pick(key, PODS)
    assert isinstance(owner, Pick)
    full = [PodView(p.name, 0, 0.0, 0.0, 0.97 if p.name == owner.pod else 0.0) for p in PODS]
    moved = pick(key, full)
    assert isinstance(moved, Pick) and moved.pod != owner.pod and moved.reason == "prefix"


def test_sessions_stick_and_win_over_the_prefix() -> None:
    features = [
        RequestFeatures(prefix_key=f"p{i}".encode(), session_id="chat-42", request_id=str(i))
        for i in range(10)
    ]
    decisions = {pick(f, PODS) for f in features}
    assert len(decisions) == 1 and next(iter(decisions)).reason == "session"  # type: ignore[union-attr]


def test_no_key_picks_the_least_loaded_by_queue_and_kv() -> None:
    views = [
        PodView("busy", 0, num_waiting=3.0, num_running=4.0, kv_usage=0.2),
        PodView("full-kv", 0, num_waiting=0.0, num_running=2.0, kv_usage=0.9),  # 2 + 3.6
        PodView("mine", 3, num_waiting=0.0, num_running=1.0, kv_usage=0.1),  # 3 in flight
    ]
    assert pick(RequestFeatures(request_id="x"), views) == Pick("mine", "load")
    assert score(views[1], PickerConfig()) == pytest.approx(2 + 4 * 0.9)


def test_stale_pods_stay_routable_with_a_penalty() -> None:
    stale = PodView("stale", 0)  # never scraped
    fresh = PodView("fresh", 1, 0.0, 1.0, 0.0)
    assert stale.is_stale and not fresh.is_stale
    # load 0 + penalty 2 > load 1: the fresh pod
    assert pick(RequestFeatures(request_id="a"), [stale, fresh]) == Pick("fresh", "load")
    busier = PodView("fresh", 4, 0.0, 4.0, 0.0)
    assert pick(RequestFeatures(request_id="a"), [stale, busier]) == Pick("stale", "load")
    # all stale: still served
    assert isinstance(pick(prefix(1), [PodView("a"), PodView("b")]), Pick)


def test_idle_pods_share_sequential_requests_without_affinity() -> None:
    chosen = collections.Counter(
        d.pod
        for d in (pick(RequestFeatures(request_id=f"req-{i}"), PODS) for i in range(200))
        if isinstance(d, Pick)
    )
    assert set(chosen) == {p.name for p in PODS}


def test_scraped_load_counts_when_other_routers_fill_a_pod() -> None:
    pod = PodView("p", num_in_flight=1, num_waiting=5.0, num_running=8.0)
    assert pod.load == 13.0
    assert PodView("q", num_in_flight=6, num_waiting=0.0, num_running=2.0).load == 6.0


def place(features: RequestFeatures, views: list[PodView], index: AffinityIndex) -> str:
    """What RouterState.route does: pick with the key's known pods, then remember the pod."""
    key, _ = affinity_key(features)
    assert key is not None
    views = [dataclasses.replace(v, num_keys=index.num_keys(v.name)) for v in views]
    decision = pick(features, views, known=index.pods(key))
    assert isinstance(decision, Pick) and decision.reason in ("prefix", "session")
    index.record(key, decision.pod)
    return decision.pod


def test_a_handful_of_prefixes_spread_evenly_then_stay_with_their_pods() -> None:
    """Hashing alone gives one of these three pods 5 of 12 prefixes (and one of three pods 6 or
    more in half of all draws); remembered placement gives each pod 4."""
    pods = PODS[:3]
    by_hash = collections.Counter(pick(prefix(n), pods).pod for n in range(12))  # type: ignore[union-attr]
    assert max(by_hash.values()) == 5
    index = AffinityIndex(max_keys=100)
    homes = {n: place(prefix(n), pods, index) for n in range(12)}
    assert collections.Counter(homes.values()) == {p.name: 4 for p in pods}
    for n in range(12):  # later requests of a prefix, whatever their id, go to its pod
        again = RequestFeatures(prefix(n).prefix_key, request_id=f"again-{n}")
        assert place(again, pods, index) == homes[n]


def test_a_new_key_goes_to_the_least_loaded_pod_and_a_known_one_stays_within_the_bound() -> None:
    views = [PodView("a", 2, 0.0, 2.0, 0.1), PodView("b", 1, 0.0, 1.0, 0.1),
             PodView("c", 0, 0.0, 0.0, 0.1)]  # fmt: skip
    assert pick(prefix(1), views) == Pick("c", "prefix")
    # "a" is the key's pod: load 2 + 1 <= ceil(1.25 * (3 + 1) / 3) = 2? no: it spills to "c"
    assert pick(prefix(1), views, known=("a",)) == Pick("c", "prefix")
    views[2] = PodView("c", 1, 0.0, 1.0, 0.1)  # total 4: capacity ceil(1.25 * 5 / 3) = 3
    assert pick(prefix(1), views, known=("a",)) == Pick("a", "prefix")
    # the spill pod is known too: after the home pod, before a less loaded stranger
    views = [PodView("a", 3, 0.0, 3.0, 0.1), PodView("b", 2, 0.0, 2.0, 0.1),
             PodView("c", 0, 0.0, 0.0, 0.1)]  # fmt: skip
    assert pick(prefix(1), views, known=("a", "b")) == Pick("b", "prefix")
    # a known pod that left is skipped
    assert pick(prefix(1), views[1:], known=("gone", "c")) == Pick("c", "prefix")


def test_the_affinity_index_is_bounded_in_keys_and_pods() -> None:
    index = AffinityIndex(max_keys=2, max_pods=2)
    index.record(b"k1", "a")
    index.record(b"k2", "b")
    assert index.pods(b"k1") == ("a",)  # k1 is now the most recently used
    index.record(b"k3", "c")  # k2 is dropped
    assert index.pods(b"k2") == () and len(index) == 2
    assert (index.num_keys("a"), index.num_keys("b"), index.num_keys("c")) == (1, 0, 1)
    index.record(b"k1", "b")
    index.record(b"k1", "c")  # the newest spill is replaced, the home pod kept
    assert index.pods(b"k1") == ("a", "c")
    assert (index.num_keys("a"), index.num_keys("b"), index.num_keys("c")) == (1, 0, 2)
    index.forget_pods({"a"})
    assert index.pods(b"k1") == ("c",) and index.num_keys("a") == 0
    index.forget_pods({"c"})
    assert len(index) == 0 and index.num_keys("c") == 0
    with pytest.raises(ValueError):
        AffinityIndex(max_keys=0)


def test_the_router_state_remembers_where_it_sent_a_key_and_forgets_a_pod_that_left() -> None:
    state = RouterState(RouterSettings(backends=["http://127.0.0.1:1", "http://127.0.0.1:2"]))
    backends = [Backend("p1", "http://127.0.0.1:1"), Backend("p2", "http://127.0.0.1:2")]
    state.set_backends(backends)
    first = asyncio.run(state.route(prefix(9)))
    assert isinstance(first, Pick)
    state.pods[first.pod].num_in_flight = 1  # the other pod is less loaded, within the bound
    assert asyncio.run(state.route(prefix(9))) == first
    assert state.views()[0].num_keys + state.views()[1].num_keys == 1
    state.set_backends([b for b in backends if b.name != first.pod])
    key, _ = affinity_key(prefix(9))
    assert state.affinity.pods(key) == ()  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, (1 << 22) + 1])
def test_affinity_keys_out_of_range_is_refused_by_name(bad: int) -> None:
    with pytest.raises(ValueError, match="affinity_keys"):
        RouterSettings(backends=["http://127.0.0.1:1"], affinity_keys=bad)
