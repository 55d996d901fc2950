"""`dev up` is idempotent and `dev down` leaves nothing running: on a second, throw-away
cluster of its own (own state folder, own ports), so the session's cluster is not disturbed."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from kubeinfer.devcluster.cluster import DevCluster
from kubeinfer.devcluster.testing import DevClusterHandle, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(240)]


def _descendants_by_state_dir(state_dir: Path) -> list[psutil.Process]:
    """Processes whose command line names the cluster's state folder (all of ours do)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(
                str(state_dir) in arg for arg in proc.info["cmdline"] or []
            ):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_up_is_idempotent_and_down_stops_everything(
    tmp_path: Path, dev_cluster: DevClusterHandle
) -> None:
    # dev_cluster is requested only so both clusters never start at the same time
    state_dir = tmp_path / "dev"
    cluster = DevCluster.from_env(state_dir, num_nodes=1)
    try:
        cluster.up()
        first = {r.name: r.pid for r in cluster.recorded_pids()}
        cluster.up()  # a second up keeps what runs
        assert {r.name: r.pid for r in cluster.recorded_pids()} == first
        assert all(s.is_healthy for s in cluster.status())

        core = cluster.core_api()
        core.create_namespaced_pod(
            "default",
            {
                "metadata": {"name": "sleeper"},
                "spec": {
                    "terminationGracePeriodSeconds": 30,
                    "containers": [
                        {
                            "name": "main",
                            "image": "python:3.11-slim",
                            # a forked grandchild that ignores SIGTERM: down must still stop it
                            "command": [
                                "sh",
                                "-c",
                                f"trap '' TERM; sleep 600 & echo {state_dir}; wait",
                            ],
                        }
                    ],
                },
            },
        )
        wait_for(
            lambda: core.read_namespaced_pod("sleeper", "default").status.phase == "Running",
            timeout_s=60,
            what="sleeper Running",
        )
        records = cluster.recorded_pids()
        assert {r.name for r in records} >= {
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "node-agent",
            "default_sleeper/main",
        }
        sleeper = next(r for r in records if r.name == "default_sleeper/main")
        sleeper_group = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == sleeper.pid]
        assert len(sleeper_group) >= 2  # sh and its sleep
    finally:
        cluster.down()
    assert not [r for r in records if r.is_alive()]
    assert not [pid for pid in sleeper_group if _running(pid)]
    assert not _descendants_by_state_dir(state_dir)
    assert not any(s.is_running for s in cluster.status())


def _pgid(pid: int) -> int | None:
    import os

    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
