"""Test support for everything that needs the dev cluster (dev-cluster, operator, helm tests).

`dev_cluster` is a session-scoped pytest fixture: it brings the cluster in `.cache/dev` up once
(from a clean state) and down at the end. A cluster that is already running (`kubeinfer dev
up` by hand) is reused and left running. Import it into a conftest.py to use it:

    from kubeinfer.devcluster.testing import dev_cluster  # noqa: F401
"""

from __future__ import annotations

import logging
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kubeinfer.devcluster.cluster import DevCluster
from kubeinfer.devcluster.config import DevClusterError

logger = logging.getLogger(__name__)
T = TypeVar("T")


class WaitTimeoutError(AssertionError):
    """A condition a test waited for did not hold in time."""


def wait_for(
    check: Callable[[], T | None], *, timeout_s: float, what: str, interval_s: float = 0.25
) -> T:
    """Call `check` until it returns something truthy; WaitTimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = check()
        except Exception as exc:  # noqa: BLE001 - keep waiting, report the last failure
            last = exc
        if last and not isinstance(last, Exception):
            return last  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise WaitTimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}: {last!r}")
        time.sleep(interval_s)


@dataclass
class DevClusterHandle:
    """A running dev cluster and clients for it."""

    cluster: DevCluster
    kubectl_path: Path
    api_client: Any = field(repr=False)

    @property
    def kubeconfig(self) -> Path:
        return self.cluster.kubeconfig

    @property
    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api_client)

    @property
    def apps(self) -> Any:
        from kubernetes import client

        return client.AppsV1Api(self.api_client)

    def kubectl(self, *args: str, check: bool = True, timeout_s: float = 60) -> str:
        """Run kubectl against the cluster; return its stdout."""
        done = subprocess.run(
            [str(self.kubectl_path), "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}"
            )
        return done.stdout

    def namespace(self, prefix: str = "t") -> str:
        """A fresh namespace (deleted by `delete_namespace`)."""
        name = f"{prefix}-{secrets.token_hex(3)}"
        self.core.create_namespace({"metadata": {"name": name}})
        wait_for(lambda: self._has_default_sa(name), timeout_s=60, what=f"default SA in {name}")
        return name

    def _has_default_sa(self, namespace: str) -> bool:
        self.core.read_namespaced_service_account("default", namespace)
        return True

    def delete_namespace(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.delete_namespace(name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def pod_log(self, namespace: str, pod: str, container: str) -> str:
        path = self.cluster.layout.root / "pods" / f"{namespace}_{pod}_{container}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _make_handle(cluster: DevCluster) -> DevClusterHandle:
    from kubernetes import config

    api_client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    return DevClusterHandle(cluster, cluster.bin_dir / "kubectl", api_client)


def _is_running(cluster: DevCluster) -> bool:
    return all(s.is_healthy for s in cluster.status())


@pytest.fixture(scope="session")
def dev_cluster() -> Iterator[DevClusterHandle]:
    """The dev cluster in .cache/dev, up for the whole session."""
    cluster = DevCluster.from_env()
    reused = cluster.layout.state_file.exists() and _is_running(cluster)
    if not reused:
        cluster.down(purge=True)  # leftovers of an earlier run: start clean
        start = time.monotonic()
        try:
            cluster.up()
        except DevClusterError as exc:
            cluster.down()
            pytest.fail(f"dev cluster did not come up: {exc}", pytrace=False)
        logger.info("dev cluster up in %.1fs", time.monotonic() - start)
    handle = _make_handle(cluster)
    try:
        yield handle
    finally:
        if not reused:
            records = cluster.recorded_pids()
            cluster.down()
            left = [r for r in records if r.is_alive()]
            if left:
                logger.error("dev down left processes running: %s", left)
