"""compute_status (phases, counts, conditions), pod_view, parse_ready and first_difference."""

from __future__ import annotations

from typing import Any

import pytest

from kubeinfer.operator.drift import first_difference
from kubeinfer.operator.readiness import ReadyReport, parse_ready
from kubeinfer.operator.status import PodView, compute_status, is_same_status, pod_view
from tests.operator.conftest import make_model

NOW = "2026-01-01T00:00:00Z"


def deployment(replicas: int, ready: int, updated: int | None = None) -> dict[str, Any]:
    status = {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated}
    return {"status": {"updatedReplicas": replicas, **{k: v for k, v in status.items() if v}}}


def pods(*specs: tuple[bool, bool, str]) -> list[PodView]:
    return [
        PodView(f"p{i}", is_running=running, is_ready=ready, restart_count=0, problem=problem)
        for i, (running, ready, problem) in enumerate(specs)
    ]


def status_of(replicas: int, dep: dict[str, Any] | None, views: list[PodView], **kw: Any):
    model = make_model({"model": {"uri": "pvc://w"}, "replicas": replicas})
    kw.setdefault("failure", None)
    return compute_status(model, dep, views, observed_generation=1, now=NOW, **kw)


@pytest.mark.parametrize(
    ("replicas", "dep", "views", "failure", "phase"),
    [
        (1, None, [], None, "Pending"),
        (1, deployment(1, 0), pods((False, False, "")), None, "Pending"),
        (1, deployment(1, 0), pods((True, False, "")), None, "Loading"),
        (1, deployment(1, 1), pods((True, True, "")), None, "Ready"),
        (2, deployment(2, 1), pods((True, True, ""), (True, False, "")), None, "Degraded"),
        (1, deployment(1, 0), pods((True, False, "pod p0: model failed to load: x")), None,
         "Failed"),
        (2, deployment(2, 2), pods((True, True, ""), (True, True, "pod p1: CrashLoopBackOff")),
         None, "Degraded"),
        (1, None, [], "spec.model.uri is bad", "Failed"),
        (0, deployment(0, 0), [], None, "Pending"),
    ],
)  # fmt: skip
def test_phases(
    replicas: int, dep: dict[str, Any] | None, views: list[PodView], failure: str | None, phase: str
) -> None:
    assert status_of(replicas, dep, views, failure=failure)["phase"] == phase


def test_counts_selector_endpoint_and_conditions() -> None:
    s = status_of(2, deployment(2, 2), pods((True, True, ""), (True, True, "")))
    assert (s["replicas"], s["readyReplicas"], s["desiredReplicas"]) == (2, 2, 2)
    assert (
        s["selector"]
        == "app.kubernetes.io/instance=smollm2,app.kubernetes.io/name=kubeinfer-runtime"
    )
    assert s["endpoint"] == "http://smollm2.models.svc:8000/v1"
    assert s["observedGeneration"] == 1
    conditions = {c["type"]: c for c in s["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Degraded"]["status"] == "False"
    assert conditions["Progressing"]["status"] == "False"


def test_load_error_reaches_the_ready_condition() -> None:
    pod = {
        "metadata": {"name": "smollm2-abc"},
        "status": {
            "containerStatuses": [
                {"name": "runtime", "ready": False, "state": {"running": {"startedAt": NOW}}}
            ]
        },
    }
    report = parse_ready(503, {"status": "failed", "error": "config.json: not found"})
    view = pod_view(pod, report)
    s = status_of(1, deployment(1, 0), [view])
    ready = s["conditions"][0]
    assert s["phase"] == "Failed" and ready["status"] == "False"
    assert "model failed to load: config.json: not found" in ready["message"]
    assert "smollm2-abc" in ready["message"]


def test_crash_loop_is_a_problem_with_the_exit_code() -> None:
    pod = {
        "metadata": {"name": "p"},
        "status": {
            "containerStatuses": [
                {
                    "name": "runtime",
                    "restartCount": 4,
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
                    "lastState": {"terminated": {"exitCode": 1, "message": "boom"}},
                }
            ]
        },
    }
    view = pod_view(pod, None)
    assert "CrashLoopBackOff" in view.problem and "exit code 1: boom" in view.problem
    assert view.restart_count == 4 and not view.is_running


def test_loading_progress_in_the_message() -> None:
    pod = {
        "metadata": {"name": "p"},
        "status": {"containerStatuses": [{"name": "runtime", "state": {"running": {}}}]},
    }
    report = parse_ready(
        503, {"status": "loading", "loaded_bytes": 1 << 20, "total_bytes": 4 << 20}
    )
    s = status_of(1, deployment(1, 0), [pod_view(pod, report)])
    assert s["phase"] == "Loading" and "loaded 1 of 4 MB" in s["conditions"][0]["message"]


def test_transition_time_kept_while_status_holds() -> None:
    model = make_model({"model": {"uri": "pvc://w"}})
    first = compute_status(model, deployment(1, 1), pods((True, True, "")), failure=None,
                           observed_generation=1, now="2026-01-01T00:00:00Z")  # fmt: skip
    model["status"] = first
    again = compute_status(model, deployment(1, 1), pods((True, True, "")), failure=None,
                           observed_generation=1, now="2026-01-01T00:05:00Z")  # fmt: skip
    assert again["conditions"] == first["conditions"]
    assert is_same_status(first, again)
    later = compute_status(model, deployment(1, 0), pods((True, False, "")), failure=None,
                           observed_generation=1, now="2026-01-01T00:09:00Z")  # fmt: skip
    assert later["conditions"][0]["lastTransitionTime"] == "2026-01-01T00:09:00Z"
    assert not is_same_status(first, later)


@pytest.mark.parametrize(
    ("code", "body", "state", "error"),
    [
        (200, {"status": "ready"}, "ready", ""),
        (503, {"status": "loading", "loaded_bytes": 1, "total_bytes": 2}, "loading", ""),
        (503, {"status": "failed", "error": "bad"}, "failed", "bad"),
        (503, {"status": "draining"}, "draining", ""),
        (502, None, "unreachable", "/ready answered HTTP 502"),
    ],
)
def test_parse_ready(code: int, body: Any, state: str, error: str) -> None:
    report = parse_ready(code, body)
    assert (report.state, report.error) == (state, error)
    assert isinstance(report, ReadyReport)


def test_first_difference() -> None:
    desired = {"metadata": {"name": "a", "labels": {"x": "1"}}, "spec": {"args": ["--a", "1"]}}
    actual = {
        "metadata": {"name": "a", "labels": {"x": "1", "extra": "y"}, "uid": "u"},
        "spec": {"args": ["--a", "1"], "defaulted": True},
        "status": {"ready": 1},
    }
    assert first_difference(desired, actual) is None
    actual["spec"]["args"] = ["--a", "2"]
    assert first_difference(desired, actual) == ".spec.args[1]"
    actual["spec"]["args"] = ["--a", "1", "--b"]
    assert first_difference(desired, actual) == ".spec.args"
    del actual["metadata"]["labels"]["x"]
    assert first_difference(desired, actual) == ".metadata.labels.x"
    assert first_difference({"spec": {"opt": {}}}, {"spec": {}}) is None  # dropped empties
    assert first_difference({"n": 8}, {"n": "8"}) is None  # int-or-string


@pytest.mark.parametrize(
    ("router", "phase"),
    [
        (None, "Ready"),  # routing mode service, or no router Deployment read yet
        ({"spec": {"replicas": 1}, "status": {"readyReplicas": 1}}, "Ready"),
        ({"spec": {"replicas": 1}, "status": {}}, "Degraded"),
        ({"spec": {"replicas": 0}, "status": {}}, "Ready"),  # a paused model's
    ],
)
def test_the_model_is_not_ready_while_its_router_has_no_ready_pod(
    router: dict[str, Any] | None, phase: str
) -> None:
    s = status_of(1, deployment(1, 1), pods((True, True, "")), router=router)
    assert s["phase"] == phase
    ready = s["conditions"][0]
    assert ready["status"] == ("True" if phase == "Ready" else "False")
    if phase == "Degraded":
        assert ready["reason"] == "RouterNotReady" and "0/1 router pods" in ready["message"]
