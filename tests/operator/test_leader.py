"""Leader election on a Lease, against a fake API with the server's optimistic concurrency:
one of two replicas wins, the other takes over after expiry or a release, never both."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kubeinfer.operator.kube import ApiError, TransientApiError
from kubeinfer.operator.leader import LeaseElector, is_free
from kubeinfer.operator.settings import OperatorSettings

T0 = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


class FakeLeaseApi:
    """One Lease; PUT must carry the current resourceVersion (409 otherwise), as the API does."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.rv = 0

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.lease)

    async def request(self, method: str, path: str, *, body: Any = None, **_: Any) -> dict:
        if method == "POST":
            if self.lease is not None:
                raise TransientApiError(409, "exists")
        elif body["metadata"].get("resourceVersion") != str(self.rv):
            raise TransientApiError(409, "conflict")
        self.rv += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.rv)
        return copy.deepcopy(self.lease)


def elector(api: FakeLeaseApi, identity: str) -> LeaseElector:
    return LeaseElector(api, "ops", "kubeinfer-operator", identity, duration_s=15, renew_s=5)  # type: ignore[arg-type]


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.mark.parametrize(
    ("spec", "now_s", "expected"),
    [
        ({}, 0, True),
        ({"holderIdentity": "me"}, 0, True),
        ({"holderIdentity": "other", "renewTime": "2026-12-04T12:00:00.000000Z",
          "leaseDurationSeconds": 15}, 10, False),
        ({"holderIdentity": "other", "renewTime": "2026-12-04T12:00:00.000000Z",
          "leaseDurationSeconds": 15}, 16, True),
        ({"holderIdentity": "", "renewTime": "2026-12-04T12:00:00.000000Z",
          "leaseDurationSeconds": 15}, 1, True),  # released
    ],
)  # fmt: skip
def test_is_free(spec: dict[str, Any], now_s: float, expected: bool) -> None:
    assert is_free(spec, "me", at(now_s)) is expected


def test_one_of_two_wins_and_the_other_takes_over_after_expiry() -> None:
    async def run() -> None:
        api = FakeLeaseApi()
        a, b = elector(api, "a"), elector(api, "b")
        assert await a.try_acquire(at(0))
        assert not await b.try_acquire(at(1))
        assert await a.try_acquire(at(5))  # renewal
        assert not await b.try_acquire(at(19))  # 14 s after the renewal: still a's
        assert await b.try_acquire(at(21))  # a stopped renewing at 5: expired at 20
        assert api.lease is not None and api.lease["spec"]["holderIdentity"] == "b"
        assert api.lease["spec"]["leaseTransitions"] == 1
        assert not await a.try_acquire(at(22))

    asyncio.run(run())


def test_a_stale_write_loses_the_round() -> None:
    """Both read a free Lease; the second write carries an old resourceVersion: 409, lost."""

    async def run() -> None:
        api = FakeLeaseApi()
        assert await elector(api, "a").try_acquire(at(0))
        stale = copy.deepcopy(api.lease)
        assert await elector(api, "a").try_acquire(at(30))
        b = elector(api, "b")
        b.api.get = lambda *_: _value(stale)  # type: ignore[method-assign]
        assert not await b.try_acquire(at(31))  # it read the old Lease, expired by then
        assert api.lease is not None and api.lease["spec"]["holderIdentity"] == "a"

    asyncio.run(run())


async def _value(v: Any) -> Any:
    return copy.deepcopy(v)


def test_release_lets_a_standby_take_over_at_once() -> None:
    async def run() -> None:
        api = FakeLeaseApi()
        a, b = elector(api, "a"), elector(api, "b")
        assert await a.try_acquire(datetime.now(UTC))
        await a.release()
        assert await b.try_acquire(datetime.now(UTC))

    asyncio.run(run())


def test_keep_returns_when_renewals_fail_past_the_deadline() -> None:
    async def run() -> float:
        api = FakeLeaseApi()
        a = LeaseElector(api, "ops", "l", "a", duration_s=2, renew_s=0.2)  # type: ignore[arg-type]
        assert await a.try_acquire()

        async def broken(*_: Any, **__: Any) -> Any:
            raise ApiError(500, "API server down")

        api.get = broken  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(a.keep(), 5)
        return loop.time() - started

    elapsed = asyncio.run(run())
    assert 1.6 <= elapsed < 2.0  # stops acting before the Lease could expire (2 s)


def test_renew_must_fit_the_duration() -> None:
    with pytest.raises(ValueError, match="lease_renew_s"):
        OperatorSettings(lease_duration_s=10, lease_renew_s=6)
