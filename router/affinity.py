"""AffinityIndex: which pods each affinity key (prefix or session) was sent to, remembered.

The picker's affinity comes from here: a key's pods are where its KV blocks were computed, so
they are where its prefix cache is warm. A key seen for the first time has none and goes by
load (the least loaded pod; of equally loaded ones, the one serving the fewest keys), which
spreads a handful of hot prefixes evenly over the pods: hashing alone gives one of three pods
6 or more of 12 prefixes in half of all draws, more than its KV pool held in bench/router.py.
This is the approximate prefix-cache scorer of llm-d's endpoint picker, kept to the prefix
key the router already computes.

Bounded: at most `max_keys` keys, least recently used dropped first, each with at most
`max_pods` pods in the order they first served it (the first is the key's home; later ones are
where bounded load spilled it; a spill past `max_pods` replaces the newest). Each router
replica has its own index, so with several replicas a key may get a home in each; ties go by
rendezvous order, the same in every replica.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class AffinityIndex:
    def __init__(self, max_keys: int, max_pods: int = 4) -> None:
        if max_keys < 1 or max_pods < 1:
            raise ValueError("max_keys and max_pods must be at least 1")
        self.max_keys = max_keys
        self.max_pods = max_pods
        self._pods: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()
        self._counts: Counter[str] = Counter()

    def num_keys(self, pod: str) -> int:
        """How many remembered keys `pod` serves."""
        return self._counts[pod]

    def __len__(self) -> int:
        return len(self._pods)

    def pods(self, key: bytes) -> tuple[str, ...]:
        """The pods `key` was sent to, first-served first (empty: never, or forgotten)."""
        pods = self._pods.get(key, ())
        if pods:
            self._pods.move_to_end(key)
        return pods

    def record(self, key: bytes, pod: str) -> None:
        """`pod` serves a request of `key` now."""
        pods = self._pods.get(key, ())
        if pod not in pods:
            if len(pods) >= self.max_pods:
                self._counts[pods[-1]] -= 1
                pods = pods[:-1]
            pods += (pod,)
            self._counts[pod] += 1
        self._pods[key] = pods
        self._pods.move_to_end(key)
        while len(self._pods) > self.max_keys:
            _, dropped = self._pods.popitem(last=False)
            self._counts.subtract(dropped)

    def forget_pods(self, gone: set[str]) -> None:
        """These pods left the routable set: their caches are gone with them (a pod that comes
        back under the same name starts cold)."""
        if not gone:
            return
        for key in list(self._pods):
            kept = tuple(p for p in self._pods[key] if p not in gone)
            if kept:
                self._pods[key] = kept
            else:
                del self._pods[key]
        for pod in gone:
            self._counts.pop(pod, None)
