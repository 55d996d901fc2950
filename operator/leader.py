"""Leader election on a coordination.k8s.io/v1 Lease: of all operator replicas, one acts.

controller-runtime's scheme, small: a replica acts only while it holds the Lease. It takes the
Lease when it is free or expired (`renewTime + leaseDurationSeconds` passed), renews it every
`renew_s`, and a replica that cannot renew before the Lease would expire stops acting (the
operator exits, and its pod's restart brings it back as a standby). A replica that stops
cleanly releases the Lease, so its successor takes over at its next try; one that dies takes
over within `duration_s + renew_s`. Writes carry the resourceVersion they read, so two
replicas never both win a round. `is_free` is the pure rule; `LeaseElector` does the calls.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from kubeinfer.operator.kube import ApiError, KubeApi, object_path

logger = logging.getLogger(__name__)

_MICRO = "%Y-%m-%dT%H:%M:%S.%fZ"


def _stamp(t: datetime) -> str:
    return t.astimezone(UTC).strftime(_MICRO)


def _parse(text: str | None) -> datetime | None:
    if not text:
        return None
    for fmt in (_MICRO, "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC)
        except ValueError:
            continue
    return None


def is_free(lease_spec: dict[str, Any], identity: str, now: datetime) -> bool:
    """May `identity` take (or keep) a Lease with this spec at `now`?"""
    holder = lease_spec.get("holderIdentity") or ""
    if not holder or holder == identity:
        return True
    renewed = _parse(lease_spec.get("renewTime")) or _parse(lease_spec.get("acquireTime"))
    if renewed is None:
        return True
    duration = int(lease_spec.get("leaseDurationSeconds") or 0)
    return now > renewed + timedelta(seconds=duration)


@dataclass
class LeaseElector:
    api: KubeApi
    namespace: str
    name: str
    identity: str
    duration_s: int = 15
    renew_s: float = 5.0

    def _path(self, with_name: bool = True) -> str:
        return object_path("Lease", self.namespace, self.name if with_name else None)

    async def try_acquire(self, now: datetime | None = None) -> bool:
        """One round: True when this replica holds the Lease after it."""
        now = now or datetime.now(UTC)
        try:
            lease = await self.api.get("Lease", self.namespace, self.name)
            if lease is None:
                await self.api.request("POST", self._path(False), body=self._body(now, None))
                return True
            spec = lease.get("spec") or {}
            if not is_free(spec, self.identity, now):
                return False
            await self.api.request("PUT", self._path(), body=self._body(now, lease))
            return True
        except ApiError as exc:  # 409: another replica won this round
            if exc.status != 409:
                logger.warning("lease %s/%s: %s", self.namespace, self.name, exc)
            return False

    def _body(self, now: datetime, lease: dict[str, Any] | None) -> dict[str, Any]:
        spec = dict((lease or {}).get("spec") or {})
        is_new_holder = spec.get("holderIdentity") != self.identity
        if is_new_holder:
            spec["acquireTime"] = _stamp(now)
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (lease is not None)
        spec.update(
            holderIdentity=self.identity,
            leaseDurationSeconds=self.duration_s,
            renewTime=_stamp(now),
        )
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if lease is not None:
            meta["resourceVersion"] = lease["metadata"]["resourceVersion"]
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                "spec": spec}  # fmt: skip

    async def acquire(self) -> None:
        """Wait until this replica holds the Lease."""
        logged = False
        while not await self.try_acquire():
            if not logged:
                logger.info("standby: lease %s/%s is held by another replica", self.namespace,
                            self.name)  # fmt: skip
                logged = True
            await asyncio.sleep(self.renew_s)
        logger.info("leading: lease %s/%s acquired as %s", self.namespace, self.name,
                    self.identity)  # fmt: skip

    async def keep(self) -> None:
        """Renew every `renew_s`; return when the Lease could not be renewed in time (this
        replica must stop acting before another may take over)."""
        loop = asyncio.get_running_loop()
        last = loop.time()
        # stop a renewal early enough that the Lease never expires while this replica acts
        deadline_s = max(self.renew_s, self.duration_s - self.renew_s)
        while True:
            await asyncio.sleep(self.renew_s)
            if await self.try_acquire():
                last = loop.time()
            elif loop.time() - last >= deadline_s:
                logger.error("lost lease %s/%s: stopping", self.namespace, self.name)
                return

    async def release(self) -> None:
        """Give the Lease up (a clean stop), so a standby takes over at its next try."""
        try:
            lease = await self.api.get("Lease", self.namespace, self.name)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1}
            body = {**lease, "spec": spec}
            await self.api.request("PUT", self._path(), body=body)
        except ApiError as exc:
            logger.warning("lease %s/%s not released: %s", self.namespace, self.name, exc)
