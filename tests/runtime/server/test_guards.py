"""The server's pure gates (limits, admission) and its probes over a stand-in engine, no model."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kubeinfer.runtime.server.admission import Admission, QueueView, refusal
from kubeinfer.runtime.server.app import create_app
from kubeinfer.runtime.server.errors import APIError
from kubeinfer.runtime.server.limits import RequestLimits
from kubeinfer.runtime.server.settings import ServerSettings
from kubeinfer.runtime.server.state import ServerState


def limits(**overrides: int) -> RequestLimits:
    settings = ServerSettings(model=Path("/m"), max_num_seqs=4, max_num_batched_tokens=100)
    return dataclasses.replace(RequestLimits.from_settings(settings, 1000), **overrides)


def test_defaults_follow_the_model_and_the_batch() -> None:
    s = ServerSettings(model=Path("/m"), max_num_seqs=8, max_num_batched_tokens=512)
    lim = RequestLimits.from_settings(s, max_model_len=8192)
    assert lim.max_input_chars == 32 * 8192
    assert lim.max_request_bytes == 8 * 32 * 8192  # 2 MiB for an 8k context
    assert RequestLimits.from_settings(s, 128).max_request_bytes == 1 << 20  # at least 1 MiB
    assert lim.max_queued_requests == 32 and lim.max_queued_tokens == 16 * 512
    unset = ServerSettings(model=Path("/m"))  # vLLM's served step budgets: CPU 2048, GPU 8192
    assert unset.engine_config().max_num_batched_tokens == 2048
    assert RequestLimits.from_settings(unset, 8192).max_queued_tokens == 16 * 2048
    cuda = ServerSettings(model=Path("/m"), device="cuda")
    assert cuda.engine_config().max_num_batched_tokens == 8192
    given = ServerSettings(model=Path("/m"), max_request_bytes=4096, max_queued_requests=3)
    lim = RequestLimits.from_settings(given, 8192)
    assert lim.max_request_bytes == 4096 and lim.max_queued_requests == 3


def test_refusal_bounds_requests_and_tokens() -> None:
    lim = limits(max_queued_requests=10, max_queued_tokens=100)
    assert refusal(QueueView(9, 0), 1, 0, lim) is None
    assert refusal(QueueView(10, 0), 1, 0, lim)[0] == "queue_requests"  # type: ignore[index]
    assert refusal(QueueView(9, 0), 2, 0, lim)[0] == "queue_requests"  # type: ignore[index]
    assert refusal(QueueView(1, 60), 0, 40, lim) is None
    assert refusal(QueueView(1, 60), 0, 41, lim)[0] == "queue_tokens"  # type: ignore[index]
    assert refusal(QueueView(0, 0), 0, 5000, lim) is None  # an empty queue takes any prompt


def test_admission_counts_requests_being_prepared() -> None:
    rejected: list[str] = []
    admission = Admission(rejected.append)
    lim = limits(max_queued_requests=3)
    with admission.preparing(QueueView(1, 0), 2, lim):
        assert admission.num_preparing == 2
        with pytest.raises(APIError) as e:
            with admission.preparing(QueueView(1, 0), 1, lim):
                pass
        assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
    assert admission.num_preparing == 0 and rejected == ["queue_requests"]


class _Engine(SimpleNamespace):
    """Stands in for AsyncEngine where only the probes and the queue are read."""

    is_running = True
    error = None
    failure = None
    num_queued = 0
    num_queued_tokens = 0
    seconds_since_progress = 0.0

    def stop(self, timeout: float = 0) -> None:
        pass


def client_with(engine: _Engine, **settings: object) -> TestClient:
    s = ServerSettings(model=Path("/m"), **settings)  # type: ignore[arg-type]
    state = ServerState(s, engine=engine)  # type: ignore[arg-type]
    state.limits = RequestLimits.from_settings(s, 128)
    return TestClient(create_app(s, state))


def num_rejected(client: TestClient, reason: str) -> float | None:
    registry = client.app.state.server.metrics.registry  # type: ignore[attr-defined]
    return registry.get_sample_value(
        "kubeinfer:requests_rejected_total", {"model_name": "m", "reason": reason}
    )


def test_health_fails_when_the_engine_makes_no_progress_with_work_pending() -> None:
    engine = _Engine()
    with client_with(engine, engine_stall_timeout=30) as client:
        assert client.get("/health").json() == {"status": "ok"}
        engine.seconds_since_progress = 29.0
        assert client.get("/health").status_code == 200
        engine.seconds_since_progress = 31.0
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "stalled"
        assert "31s" in r.json()["error"]


def test_a_full_queue_gets_429_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _Engine(num_queued=3, engine=SimpleNamespace(tokenizer=None, max_model_len=128))
    with client_with(engine, max_queued_requests=3) as client:
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3]})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert num_rejected(client, "queue_requests") == 1
        assert num_rejected(client, "queue_tokens") == 0


def test_shutdown_refuses_new_work_after_the_delay() -> None:
    engine = _Engine(engine=SimpleNamespace(max_model_len=128))
    s = ServerSettings(model=Path("/m"))
    state = ServerState(s, engine=engine)  # type: ignore[arg-type]
    state.limits = RequestLimits.from_settings(s, 128)
    with TestClient(create_app(s, state)) as client:
        state.draining = True  # the delay: not ready, still serving
        assert client.get("/ready").status_code == 503
        assert client.get("/v1/models").status_code == 200
        state.refusing = True
        r = client.get("/v1/models")
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]


def test_the_probe_port_must_differ_from_the_api_port() -> None:
    with pytest.raises(ValueError, match="probe_port must differ"):
        ServerSettings(model=Path("/m"), port=8000, probe_port=8000)
    assert ServerSettings(model=Path("/m"), probe_port=8001).probe_port == 8001
