"""reconcile(key) against a fake API whose writes reach the store as watch events would: the
snapshot it reads, the order of its writes, and a second reconcile of the same world writing
nothing. No cluster, no kopf, no sleeps."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from kubeinfer.operator.kube import RejectedError
from kubeinfer.operator.manifests import KIND, labels
from kubeinfer.operator.metrics import OperatorMetrics
from kubeinfer.operator.reconciler import Reconciler
from kubeinfer.operator.settings import OperatorSettings
from kubeinfer.operator.workqueue import WorkQueue
from tests.operator.conftest import make_model

KEY = ("models", "smollm2")


class FakeApi:
    """The API server, the Deployment controller (observes each Deployment at once) and the
    watches (each write reaches `watch`, unless `is_watch_lagging`)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[str] = []  # writes and reads, in the order they reached the API
        self.reject: str | None = None
        self.is_watch_lagging = False
        self.reconciler: Reconciler | None = None
        self._rv = 0

    def watch(self, kind: str, event: str, body: dict[str, Any]) -> None:
        if self.reconciler is not None and not self.is_watch_lagging:
            self.reconciler.observe(kind, event, copy.deepcopy(body))

    def put(self, body: dict[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        meta.setdefault("uid", f"uid-{body['kind']}-{meta['name']}")
        meta["generation"] = meta.get("generation", 0) + 1
        if body["kind"] == "Deployment":
            body["spec"].setdefault("replicas", 1)
            body["status"] = {"observedGeneration": meta["generation"]}
        self.objects[(body["kind"], meta["namespace"], meta["name"])] = body
        self.watch(body["kind"], "MODIFIED", body)
        return body

    async def apply(self, manifest: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.calls.append(manifest["kind"])
        if self.reject:
            raise RejectedError(422, self.reject)
        meta = manifest["metadata"]
        old = self.objects.get((manifest["kind"], meta["namespace"], meta["name"]))
        body = copy.deepcopy(manifest)
        if old is not None:
            body["metadata"] |= {k: old["metadata"][k] for k in ("uid", "generation")}
            body["spec"].setdefault("replicas", old["spec"].get("replicas"))
        return self.put(body)

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(f"read {kind}")
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        self.calls.append(f"delete {kind}")
        gone = self.objects.pop((kind, namespace, name), None)
        if gone is not None:
            self.watch(kind, "DELETED", gone)
        return gone is not None

    async def scale_deployment(self, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        self.calls.append(f"scale {replicas}")
        dep = copy.deepcopy(self.objects[("Deployment", namespace, name)])
        dep["spec"]["replicas"] = replicas
        return self.put(dep)

    async def apply_model_status(self, ns: str, name: str, status: dict[str, Any]) -> dict:
        self.calls.append("status")
        model = self.objects[(KIND, ns, name)]
        model["status"] = {**(model.get("status") or {}), **status}
        self.watch(KIND, "MODIFIED", model)
        return model

    async def create_event(self, _obj: Any, _type: str, reason: str, *_: Any) -> None:
        self.calls.append(f"event {reason}")

    async def close(self) -> None:
        return None


def setup(model: dict[str, Any] | None = None) -> tuple[Reconciler, FakeApi]:
    api = FakeApi()
    r = Reconciler(api, OperatorSettings(), OperatorMetrics(), queue=WorkQueue())  # type: ignore[arg-type]
    api.reconciler = r
    model = copy.deepcopy(model or make_model())
    api.objects[(KIND, "models", model["metadata"]["name"])] = model
    r.observe(KIND, "ADDED", model)
    return r, api


def converge(r: Reconciler, key: tuple[str, str] = KEY, max_passes: int = 6) -> list[float | None]:
    """Reconcile `key` until a pass asks for nothing more; each pass's requeue."""

    async def run() -> list[float | None]:
        requeues = []
        for _ in range(max_passes):
            requeue = await r.reconcile(key)
            requeues.append(requeue)
            if requeue is None:
                return requeues
        return requeues

    return asyncio.run(run())


SERVICE_MODE = make_model({"model": {"uri": "pvc://weights"}, "routing": {"mode": "service"}})


def test_a_new_model_gets_its_deployment_first_then_the_rest_then_nothing() -> None:
    r, api = setup(SERVICE_MODE)
    assert r.queue._waiting == {KEY: True}  # noqa: SLF001 - no Deployment: urgent
    assert converge(r) == [0.0, None]
    assert api.calls == ["read Deployment", "Deployment",  # the first pass: the urgent write
                         "read Service", "Service", "status", "event Applied",
                         "event Pending"]  # fmt: skip
    status = api.objects[(KIND, *KEY)]["status"]
    assert status["observedGeneration"] == 1 and status["phase"] == "Pending"
    api.calls.clear()
    assert converge(r) == [None] and api.calls == []  # idempotent: no read, no write
    assert r.metrics.reconciles.labels("unchanged")._value.get() == 1  # noqa: SLF001


def test_a_stale_watch_is_read_past_and_converges() -> None:
    """The watch has not delivered the operator's own writes yet: names it does not show are
    read, so nothing is created twice nor taken for someone else's."""
    r, api = setup(SERVICE_MODE)
    api.is_watch_lagging = True
    converge(r)
    assert api.calls.count("read Deployment") == 2 and api.calls.count("Deployment") == 1
    assert api.calls.count("Service") == 1 and "status" in api.calls


def test_a_deleted_deployment_is_restored_and_counted_as_drift() -> None:
    r, api = setup()
    converge(r)
    dep = api.objects.pop(("Deployment", *KEY))
    r.observe("Deployment", "DELETED", dep)
    assert r.queue._waiting == {KEY: True}  # noqa: SLF001 - urgent again
    api.calls.clear()
    converge(r)
    assert api.calls[:3] == ["read Deployment", "Deployment", "event DriftRepaired"]
    assert r.metrics.drift_repairs.labels("Deployment")._value.get() == 1  # noqa: SLF001


def test_a_rejected_apply_fails_the_model_without_raising() -> None:
    r, api = setup()
    api.reject = "HTTP 422: spec.template.spec.tolerations[0].operator: Invalid value"
    assert converge(r) == [None]
    status = api.objects[(KIND, *KEY)]["status"]
    assert status["phase"] == "Failed" and "tolerations" in status["conditions"][0]["message"]
    assert "event InvalidSpec" in api.calls
    api.calls.clear()
    converge(r)  # tried again (its status write's event): nothing new to write
    assert api.calls == ["read Deployment", "Deployment"]


def test_autoscaled_replicas_go_through_scale_after_the_create() -> None:
    spec = {"model": {"uri": "pvc://w"}, "replicas": 2, "autoscaling": {"enabled": True}}
    r, api = setup(make_model(spec))
    converge(r)
    assert api.calls[:3] == ["read Deployment", "Deployment", "scale 2"]
    assert api.objects[("Deployment", *KEY)]["spec"]["replicas"] == 2
    assert "desiredReplicas" not in api.objects[(KIND, *KEY)]["status"]


def test_a_foreign_service_fails_the_model_and_is_left_alone() -> None:
    r, api = setup()
    theirs = {"apiVersion": "v1", "kind": "Service", "spec": {"selector": {"app": "theirs"}},
              "metadata": {"name": "smollm2", "namespace": "models", "uid": "theirs",
                           "labels": labels("smollm2")}}  # fmt: skip
    api.objects[("Service", *KEY)] = copy.deepcopy(theirs)
    r.observe("Service", "ADDED", theirs)  # labels copied onto it: the watch shows it
    assert asyncio.run(r.reconcile(KEY)) == 30.0  # looked at again in 30 s
    assert api.objects[("Service", *KEY)] == theirs and api.calls[-2:] == [
        "event NotOwned",
        "event Failed",
    ]
    assert "Service" not in api.calls and "Deployment" not in api.calls
    status = api.objects[(KIND, *KEY)]["status"]
    assert status["phase"] == "Failed" and status["conditions"][0]["reason"] == "NotOwned"
    # gone: the next look (30 s later) applies the model's own
    del api.objects[("Service", *KEY)]
    r.observe("Service", "DELETED", theirs)
    converge(r)
    assert api.objects[("Service", *KEY)]["metadata"]["ownerReferences"][0]["kind"] == KIND
    assert api.objects[(KIND, *KEY)]["status"]["phase"] == "Pending"


def test_a_deleted_model_is_forgotten() -> None:
    r, api = setup()
    converge(r)
    r.observe(KIND, "DELETED", api.objects.pop((KIND, *KEY)))
    api.calls.clear()
    assert converge(r) == [None] and api.calls == []


def test_a_loading_pods_ready_is_read_once_a_probe_interval(monkeypatch: Any) -> None:
    """Each status write (new load progress) is a model event, hence a reconcile: reading
    /ready again in each made a status write storm while a pod loaded (first cluster run)."""
    from kubeinfer.operator import reconciler as module
    from kubeinfer.operator.readiness import ReadyReport

    num_reads = 0

    async def read_ready(*_: Any) -> ReadyReport:
        nonlocal num_reads
        num_reads += 1
        return ReadyReport("loading", loaded_bytes=num_reads << 20, total_bytes=8 << 20)

    monkeypatch.setattr(module, "read_ready", read_ready)
    r, api = setup()
    converge(r)
    r._http = object()  # type: ignore[assignment]  # noqa: SLF001 - read_ready is faked
    dep = api.objects[("Deployment", *KEY)]
    rs = {"kind": "ReplicaSet", "metadata": {"name": "smollm2-a", "namespace": "models",
          "uid": "rs-1", "labels": labels("smollm2"),
          "ownerReferences": [{"uid": dep["metadata"]["uid"], "controller": True}]}}  # fmt: skip
    running = {"name": "runtime", "ready": False, "state": {"running": {}}}
    pod = {"kind": "Pod", "metadata": {"name": "smollm2-a-1", "namespace": "models",
           "labels": labels("smollm2"), "ownerReferences": [{"uid": "rs-1", "controller": True}]},
           "status": {"podIP": "127.1.0.9", "containerStatuses": [running]}}  # fmt: skip
    r.observe("ReplicaSet", "ADDED", rs)
    r.observe("Pod", "ADDED", pod)
    requeues = converge(r, max_passes=3)  # the status write's event queues it again, and so on
    assert requeues == [r.settings.pod_probe_interval_s] * 3 and num_reads == 1
    status = api.objects[(KIND, *KEY)]["status"]
    assert status["phase"] == "Loading" and "loaded 1 of 8 MB" in status["conditions"][0]["message"]
    r.observe("Pod", "DELETED", pod)
    assert r.reports == {}


def test_a_routed_model_gets_its_router_in_the_second_pass_and_then_nothing() -> None:
    """Routing mode router (the default): the router's children are read by their own names
    (NAME-router) and applied with the Service; a second reconcile writes nothing."""
    r, api = setup()
    assert converge(r) == [0.0, None]
    assert api.calls[:2] == ["read Deployment", "Deployment"]
    reads = ["read Service", "read ServiceAccount", "read Role", "read RoleBinding",
             "read Deployment"]  # fmt: skip
    assert api.calls[2:7] == reads
    assert sorted(api.calls[7:12]) == sorted(["Service", "ServiceAccount", "Role", "RoleBinding",
                                              "Deployment"])  # fmt: skip
    for kind in ("ServiceAccount", "Role", "RoleBinding", "Deployment"):
        assert (kind, "models", "smollm2-router") in api.objects
    service = api.objects[("Service", "models", "smollm2")]
    assert service["spec"]["selector"]["app.kubernetes.io/name"] == "kubeinfer-router"
    api.calls.clear()
    assert converge(r) == [None] and api.calls == []


def test_switching_to_service_mode_deletes_the_router_and_only_it() -> None:
    r, api = setup()
    converge(r)
    model = copy.deepcopy(api.objects[(KIND, *KEY)])
    model["spec"]["routing"] = {"mode": "service"}
    model["metadata"]["generation"] = 2
    api.objects[(KIND, *KEY)] = model
    r.observe(KIND, "MODIFIED", model)
    api.calls.clear()
    converge(r)
    deletes = sorted(c for c in api.calls if c.startswith("delete"))
    assert deletes == ["delete Deployment", "delete Role", "delete RoleBinding",
                       "delete ServiceAccount"]  # fmt: skip
    assert ("Deployment", "models", "smollm2") in api.objects  # the runtime's stays
    assert not any(name == "smollm2-router" for _, _, name in api.objects)
    service = api.objects[("Service", "models", "smollm2")]
    assert service["spec"]["selector"]["app.kubernetes.io/name"] == "kubeinfer-runtime"
