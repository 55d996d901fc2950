"""The runtime's test hook `--metrics-fault-file`: /metrics fails while the file exists.

The autoscaler's cluster test blocks a pod's scrapes with it; the app is built without its
lifespan (no model load), since /metrics answers before the weights are in.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kubeinfer.runtime.server.app import create_app
from kubeinfer.runtime.server.settings import ServerSettings


def test_metrics_answer_503_while_the_fault_file_exists(tmp_path: Path) -> None:
    fault = tmp_path / "block-metrics"
    app = create_app(ServerSettings(model=tmp_path, metrics_fault_file=fault))
    client = TestClient(app)  # no `with`: the lifespan (model load) never runs
    assert client.get("/metrics").status_code == 200
    assert "vllm:num_requests_running" in client.get("/metrics").text
    fault.touch()
    blocked = client.get("/metrics")
    assert blocked.status_code == 503 and "vllm:" not in blocked.text
    assert client.get("/health").status_code == 200  # only the metrics fail
    fault.unlink()
    assert client.get("/metrics").status_code == 200


def test_the_fault_file_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBEINFER_METRICS_FAULT_FILE", raising=False)
    assert ServerSettings(model=tmp_path).metrics_fault_file is None
    monkeypatch.setenv("KUBEINFER_METRICS_FAULT_FILE", str(tmp_path / "f"))
    assert ServerSettings(model=tmp_path).metrics_fault_file == tmp_path / "f"
