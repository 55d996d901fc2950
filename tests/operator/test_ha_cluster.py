"""Two operator replicas with leader election (the chart's settings: a 15 s Lease renewed
every 5 s): exactly one acts, the other is a healthy standby; when the leader is killed
(SIGKILL, no release), the standby acts within 30 s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kubeinfer.devcluster.testing import DevClusterHandle, wait_for
from kubeinfer.operator.testing import OperatorProcess
from tests.operator.conftest import CRD_PATH
from tests.operator.test_operator_cluster import GROUP, PLURAL, VERSION, Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

FAILOVER_BOUND_S = 30


@pytest.fixture(scope="module")
def cluster(
    dev_cluster: DevClusterHandle, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    dev_cluster.kubectl("apply", "-f", str(CRD_PATH))
    dev_cluster.kubectl(
        "wait", "--for=condition=established", "crd/inferencemodels.kubeinfer.dev", "--timeout=60s"
    )
    c = Cluster(dev_cluster, dev_cluster.namespace("ha"), tmp_path_factory.mktemp("ha"))
    try:
        yield c
    finally:
        dev_cluster.kubectl("delete", "inferencemodels", "--all", "-n", c.ns, "--wait=false",
                            check=False)  # fmt: skip
        dev_cluster.delete_namespace(c.ns)


def is_leader(op: OperatorProcess) -> bool | None:
    """The replica's kubeinfer_operator_leader gauge; None when it does not answer."""
    try:
        text = httpx.get(op.metrics_url, timeout=2).text
    except httpx.HTTPError:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "kubeinfer_operator_leader":
            return family.samples[0].value == 1
    return None


def create_model(cluster: Cluster, name: str) -> None:
    body: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceModel",
        "metadata": {"name": name},
        "spec": {"model": {"uri": "pvc://weights"}, "replicas": 0},
    }
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, body)


def test_one_replica_acts_and_the_other_takes_over_when_it_dies(cluster: Cluster) -> None:
    env = {
        "KUBEINFER_OPERATOR_LEADER_ELECTION": "true",
        "KUBEINFER_OPERATOR_LEADER_ELECTION_NAMESPACE": cluster.ns,
    }
    ops = [
        OperatorProcess.start(
            cluster.dev.kubeconfig,
            [cluster.ns],
            cluster.log_dir / f"operator-{i}.log",
            extra_env=env,
        )  # fmt: skip
        for i in range(2)
    ]
    try:

        def both_roles() -> list[bool] | None:
            roles = [is_leader(op) for op in ops]
            return None if None in roles else roles  # type: ignore[return-value]

        roles = wait_for(both_roles, timeout_s=30, what="both replicas to report")
        assert sorted(roles) == [False, True], roles  # exactly one leads; both are healthy
        leader, standby = (ops[0], ops[1]) if roles[0] else (ops[1], ops[0])
        assert httpx.get(standby.healthz_url, timeout=2).status_code == 200

        create_model(cluster, "first")
        wait_for(
            lambda: cluster.get("Deployment", "first"), timeout_s=30, what="first's Deployment"
        )
        time.sleep(2)
        assert is_leader(standby) is False
        log = standby.tail(100_000)
        assert "standby: lease" in log and "leading:" not in log  # it never acted

        leader.kill()  # no release: the standby waits for the Lease to expire
        killed_at = time.monotonic()
        create_model(cluster, "second")
        wait_for(
            lambda: cluster.get("Deployment", "second"),
            timeout_s=FAILOVER_BOUND_S + 10,
            what="second's Deployment after the failover",
        )
        failover_s = time.monotonic() - killed_at
        print(f"failover: the standby acted {failover_s:.1f} s after the leader was killed")
        assert failover_s <= FAILOVER_BOUND_S
        assert is_leader(standby) is True
        cluster.wait_phase("second", "Pending", 30)  # it writes status too
    finally:
        for op in ops:
            op.stop()
