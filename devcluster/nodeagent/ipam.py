"""Pod IPs from 127.1.0.0/16: loopback only, so every pod's server is reachable from this
machine and from nowhere else. Addresses are handed out round-robin, so a just-freed address
is not reused at once (a client that still holds it then gets "connection refused", not
another pod)."""

from __future__ import annotations

import hashlib
import ipaddress
import threading


class IpamExhaustedError(RuntimeError):
    """Every address of the pod range is in use."""


class Ipam:
    def __init__(self, cidr: str = "127.1.0.0/16", start_key: str = "") -> None:
        network = ipaddress.ip_network(cidr)
        if not network.subnet_of(ipaddress.ip_network("127.0.0.0/8")):
            raise ValueError(f"pod range {cidr} is not loopback")
        # skip .0 and .255 of each /24: never ambiguous, even to tools that assume /24s
        self._pool = [str(ip) for ip in network.hosts() if ip.packed[-1] not in (0, 255)]
        self._by_uid: dict[str, str] = {}
        # Two dev clusters on one machine (two checkouts, or CI beside a developer) share the
        # loopback range: each starts its round-robin at an offset taken from its own key, so
        # their pods do not compete for the same first addresses.
        digest = hashlib.sha256(start_key.encode()).digest()
        self._next = int.from_bytes(digest[:4], "big") % len(self._pool) if start_key else 0
        self._lock = threading.Lock()

    def allocate(self, uid: str, preferred: str | None = None) -> str:
        """The pod's address: its current one, `preferred` when free (an agent restart keeps
        a pod's IP), else the next free one."""
        with self._lock:
            if uid in self._by_uid:
                return self._by_uid[uid]
            used = set(self._by_uid.values())
            if preferred and preferred in self._pool and preferred not in used:
                self._by_uid[uid] = preferred
                return preferred
            for i in range(len(self._pool)):
                ip = self._pool[(self._next + i) % len(self._pool)]
                if ip not in used:
                    self._next = (self._next + i + 1) % len(self._pool)
                    self._by_uid[uid] = ip
                    return ip
            raise IpamExhaustedError(f"all {len(self._pool)} pod addresses are in use")

    def release(self, uid: str) -> None:
        with self._lock:
            self._by_uid.pop(uid, None)

    def in_use(self) -> dict[str, str]:
        with self._lock:
            return dict(self._by_uid)
