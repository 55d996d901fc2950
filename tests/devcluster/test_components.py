"""The control plane's command lines, without starting anything."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from kubeinfer.devcluster.components import Layout, Ports, command_line


def test_the_service_range_holds_the_operator_benchmarks_services() -> None:
    """bench/operator_scale.py makes 500 Services; a /24 failed the 255th with "failed to
    allocate a serviceIP: range is full" (HTTP 500), and kopf retried the rest forever."""
    ports = Ports(**{name: 1 for name in Ports.__dataclass_fields__})
    argv = command_line("kube-apiserver", Path("/bin"), Layout(Path("/state")), ports)
    (flag,) = [a for a in argv if a.startswith("--service-cluster-ip-range=")]
    network = ipaddress.ip_network(flag.split("=", 1)[1])
    assert network.num_addresses >= 4 * 500
