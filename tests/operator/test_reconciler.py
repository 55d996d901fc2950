"""Reconciler against a fake API: apply, drift repair, stale PDB removal, Failed on a rejected
spec, replicas through the scale subresource. No cluster, no kopf."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

from kubeinfer.operator.kube import RejectedError
from kubeinfer.operator.metrics import OperatorMetrics
from kubeinfer.operator.reconciler import Reconciler
from kubeinfer.operator.settings import OperatorSettings
from tests.operator.conftest import make_model


class FakeApi:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.num_applies = 0
        self.deleted: list[tuple[str, str, str]] = []
        self.scaled: list[int] = []
        self.statuses: list[dict[str, Any]] = []
        self.reject: str | None = None
        self.calls: list[str] = []  # in the order the writes reached the API
        self.reads: list[str] = []  # kinds read with get()
        self.latency_s = 0.0
        self._rv = 0

    async def apply(self, manifest: dict[str, Any], **_: Any) -> dict[str, Any]:
        if self.reject:
            raise RejectedError(422, self.reject)
        self.num_applies += 1
        self.calls.append(manifest["kind"])
        await asyncio.sleep(self.latency_s)
        meta = manifest["metadata"]
        key = (manifest["kind"], meta["namespace"], meta["name"])
        old = self.objects.get(key)
        body = copy.deepcopy(manifest)
        same = old is not None and json.dumps(
            {k: v for k, v in old.items() if k != "metadata"}, sort_keys=True
        ) == json.dumps({k: v for k, v in body.items() if k != "metadata"}, sort_keys=True)
        if same:
            return old  # type: ignore[return-value]
        self._rv += 1
        body["metadata"]["resourceVersion"] = str(self._rv)
        self.objects[key] = body
        return body

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        self.deleted.append((kind, namespace, name))
        return self.objects.pop((kind, namespace, name), None) is not None

    async def scale_deployment(self, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        self.scaled.append(replicas)
        self.objects[("Deployment", namespace, name)]["spec"]["replicas"] = replicas
        return {}

    async def apply_model_status(self, ns: str, name: str, status: dict[str, Any]) -> dict:
        self.calls.append("status")
        self.statuses.append(status)
        return {**make_model(name=name), "status": status}

    async def create_event(self, *_: Any) -> None:
        self.calls.append("event")

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads.append(kind)
        return self.objects.get((kind, namespace, name))

    async def close(self) -> None:
        return None


def reconciler() -> tuple[Reconciler, FakeApi]:
    api = FakeApi()
    return Reconciler(api, OperatorSettings(), OperatorMetrics()), api  # type: ignore[arg-type]


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.05)


async def applied_reconciler() -> tuple[Reconciler, FakeApi]:
    """A reconciler that has applied the default model, its writes settled."""
    r, api = reconciler()
    model = make_model()
    r.observe_model("ADDED", model)
    await r.apply(model)
    await settle()
    return r, api


def hold_status_writes(api: FakeApi) -> asyncio.Event:
    """Status writes wait on the API until the returned event is set."""
    release = asyncio.Event()
    written = api.apply_model_status

    async def slow_write(ns: str, name: str, status: dict[str, Any]) -> dict:
        await release.wait()
        return await written(ns, name, status)

    api.apply_model_status = slow_write  # type: ignore[method-assign]
    return release


def test_apply_then_drift_repairs() -> None:
    async def run() -> None:
        r, api = reconciler()
        model = make_model()
        r.observe_model("ADDED", model)
        await r.apply(model)
        assert {k[0] for k in api.objects} == {"Deployment", "Service"}
        applied = api.num_applies
        await r.apply(model)  # nothing changed: applies, but no child changes
        assert api.num_applies == applied + 2
        dep = copy.deepcopy(api.objects[("Deployment", "models", "smollm2")])
        r.observe_child("MODIFIED", dep)  # the same as applied: no repair
        await settle()
        assert api.num_applies == applied + 2
        dep["spec"]["template"]["spec"]["containers"][0]["args"][1] = "/elsewhere"
        r.observe_child("MODIFIED", dep)
        await settle()
        assert api.num_applies == applied + 4
        api.objects.pop(("Service", "models", "smollm2"))
        r.observe_child("DELETED", dep | {"kind": "Service"})
        await settle()
        assert ("Service", "models", "smollm2") in api.objects
        assert r.metrics.drift_repairs.labels("Service")._value.get() == 1  # noqa: SLF001
        assert api.statuses and api.statuses[-1]["observedGeneration"] == 1
        await r.close()

    asyncio.run(run())


def test_a_burst_of_new_models_gets_every_deployment_before_any_other_write() -> None:
    """bench/operator_scale.py: 500 models created in ~5 s waited 9.5 s (p50) for their
    Deployments, each queued behind the Services, status writes and events of the models
    before it on a 2-core API server. A missing Deployment now goes first; the rest waits
    until the burst is over."""

    async def run() -> None:
        r, api = reconciler()
        r.priority.quiet_s = 0.1
        api.latency_s = 0.05
        models = [make_model(name=f"m{i}", uid=f"uid-{i}") for i in range(5)]

        async def created(i: int, model: dict[str, Any]) -> None:
            await asyncio.sleep(0.02 * i)  # arriving one by one, as creates do
            r.observe_model("ADDED", model)
            await r.apply(model)

        await asyncio.gather(*(created(i, m) for i, m in enumerate(models)))
        await settle()
        assert api.calls[:5] == ["Deployment"] * 5, api.calls
        assert sorted(api.calls[5:]) == ["Service"] * 5 + ["event"] * 10 + ["status"] * 5
        # once a model's Deployment exists, an update is no longer urgent but still applies
        updated = make_model({"model": {"uri": "pvc://other"}}, name="m0", uid="uid-0")
        r.observe_model("MODIFIED", updated)
        await r.apply(updated)
        assert api.calls.count("Deployment") == 6
        dep = api.objects[("Deployment", "models", "m0")]
        assert '"claimName": "other"' in json.dumps(dep["spec"]["template"]["spec"]), dep
        await r.close()

    asyncio.run(run())


def test_a_deployment_deleted_while_its_first_apply_waits_its_turn_is_repaired() -> None:
    """The first apply now waits (after its Deployment) until a burst is over; a Deployment
    deleted then came while the model counted as not applied yet, and was never restored."""

    async def run() -> None:
        r, api = reconciler()
        r.priority.quiet_s = 0.05
        model = make_model()
        r.observe_model("ADDED", model)
        burst_over = asyncio.Event()

        async def another_new_model() -> None:
            async with r.priority.urgent():
                await burst_over.wait()

        other = asyncio.create_task(another_new_model())
        await asyncio.sleep(0)
        first = asyncio.create_task(r.apply(model))
        await settle()  # its Deployment is out; its Service waits for the burst
        assert api.calls == ["Deployment"]
        dep = api.objects.pop(("Deployment", "models", "smollm2"))
        r.observe_child("DELETED", dep)
        burst_over.set()
        await asyncio.gather(other, first)
        await settle()
        assert ("Deployment", "models", "smollm2") in api.objects
        assert r.metrics.drift_repairs.labels("Deployment")._value.get() == 1  # noqa: SLF001
        await r.close()

    asyncio.run(run())


def test_drift_seen_while_a_repair_runs_gets_a_repair_after_it() -> None:
    """The cluster test deleted the Deployment, then edited the recreated one's args while
    that repair was still writing the Service (after the Deployment, in its turn): the edit's
    repair was dropped because one was running, and the args stayed edited."""

    async def run() -> None:
        r, api = await applied_reconciler()
        key = ("Deployment", "models", "smollm2")
        r.observe_child("DELETED", api.objects.pop(key))
        await asyncio.sleep(0.01)  # the repair has recreated the Deployment, the rest waits
        assert key in api.objects and r.state(("models", "smollm2")).repair_task is not None
        edited = copy.deepcopy(api.objects[key])
        edited["spec"]["template"]["spec"]["containers"][0]["args"][1] = "/elsewhere"
        api.objects[key] = edited
        r.observe_child("MODIFIED", edited)
        await settle()
        args = api.objects[key]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[1] != "/elsewhere"
        await r.close()

    asyncio.run(run())


def test_children_of_someone_else_are_left_alone() -> None:
    async def run() -> None:
        r, api = reconciler()
        model = make_model()
        r.observe_model("ADDED", model)
        await r.apply(model)
        before = api.num_applies
        stranger = copy.deepcopy(api.objects[("Deployment", "models", "smollm2")])
        stranger["metadata"]["ownerReferences"][0]["uid"] = "another-model"
        stranger["spec"]["replicas"] = 7
        r.observe_child("MODIFIED", stranger)
        await settle()
        assert api.num_applies == before
        await r.close()

    asyncio.run(run())


def test_pdb_goes_when_replicas_drop_to_one() -> None:
    async def run() -> None:
        r, api = reconciler()
        model = make_model({"model": {"uri": "pvc://w"}, "replicas": 3})
        r.observe_model("ADDED", model)
        await r.apply(model)
        pdb = copy.deepcopy(api.objects[("PodDisruptionBudget", "models", "smollm2")])
        model = make_model({"model": {"uri": "pvc://w"}, "replicas": 1}, generation=2)
        r.observe_model("MODIFIED", model)
        await r.apply(model)
        assert api.deleted == [("PodDisruptionBudget", "models", "smollm2")]
        # the watch then reports the PDB's deletion: the operator's own doing, not drift
        before = api.num_applies
        r.observe_child("DELETED", pdb)
        await settle()
        assert api.num_applies == before
        assert r.metrics.drift_repairs.labels("PodDisruptionBudget")._value.get() == 0  # noqa: SLF001
        await r.close()

    asyncio.run(run())


def test_rejected_spec_is_failed_not_raised() -> None:
    async def run() -> None:
        r, api = reconciler()
        api.reject = "HTTP 422: spec.template.spec.tolerations[0].operator: Invalid value"
        model = make_model()
        r.observe_model("ADDED", model)
        await r.apply(model)  # no exception: kopf must not retry forever
        await settle()
        status = api.statuses[-1]
        assert status["phase"] == "Failed"
        assert "tolerations" in status["conditions"][0]["message"]
        await r.close()

    asyncio.run(run())


def test_autoscaled_replicas_go_through_scale() -> None:
    async def run() -> None:
        r, api = reconciler()
        spec = {"model": {"uri": "pvc://w"}, "replicas": 2, "autoscaling": {"enabled": True}}
        model = make_model(spec)
        r.observe_model("ADDED", model)
        await r.apply(model)
        dep = api.objects[("Deployment", "models", "smollm2")]
        assert api.scaled == [2] and dep["spec"]["replicas"] == 2
        await settle()
        assert "desiredReplicas" not in api.statuses[-1]  # the autoscaler's field
        await r.close()

    asyncio.run(run())


def test_a_change_seen_while_a_status_write_is_in_flight_is_written_after_it() -> None:
    """The dev cluster showed readyReplicas stuck at 1 with two ready pods for 50 s: the
    Deployment's readyReplicas=2 event came while the previous status write was on its way,
    and a request made then was dropped instead of followed by another write."""

    async def run() -> None:
        r, api = await applied_reconciler()
        release = hold_status_writes(api)
        dep = copy.deepcopy(api.objects[("Deployment", "models", "smollm2")])
        r.observe_child("MODIFIED", dep | {"status": {"replicas": 1, "readyReplicas": 0}})
        await settle()  # that write is now waiting on the API
        r.observe_child("MODIFIED", dep | {"status": {"replicas": 1, "readyReplicas": 1}})
        release.set()
        await settle()
        assert api.statuses[-1]["readyReplicas"] == 1
        await r.close()

    asyncio.run(run())


def test_no_status_is_written_for_the_old_generation_while_a_spec_change_is_applied() -> None:
    """CI: after a maxNumSeqs change the model read Ready, updatedReplicas 1, with the old
    observedGeneration: the new pod's events were written in status while the apply still
    waited on its Service, with the generation of the apply before. A status computed during
    an apply now waits for it, so observedGeneration never lags the Deployment it describes."""

    async def run() -> None:
        r, api = await applied_reconciler()
        gate = asyncio.Event()
        applied = api.apply

        async def gated_apply(manifest: dict[str, Any], **kw: Any) -> dict[str, Any]:
            if manifest["kind"] == "Service":
                await gate.wait()
            return await applied(manifest, **kw)

        api.apply = gated_apply  # type: ignore[method-assign]
        changed = make_model({"model": {"uri": "pvc://weights"}, "runtime": {"maxNumSeqs": 8}})
        changed["metadata"]["generation"] = 2
        r.observe_model("MODIFIED", changed)
        task = asyncio.create_task(r.apply(changed))
        await settle()  # the new Deployment is applied; the Service waits
        dep = copy.deepcopy(api.objects[("Deployment", "models", "smollm2")])
        before = len(api.statuses)
        r.observe_child("MODIFIED", dep | {"status": {"replicas": 1, "readyReplicas": 1}})
        await settle()
        assert len(api.statuses) == before  # nothing written for generation 1 meanwhile
        gate.set()
        await task
        await settle()
        assert len(api.statuses) > before
        assert all(s["observedGeneration"] == 2 for s in api.statuses[before:])
        await r.close()

    asyncio.run(run())


def test_a_status_write_answered_with_the_old_generation_does_not_undo_a_newer_model() -> None:
    """CI again, after the test above: observedGeneration still lagged. A status write sent
    before the spec change came back with the model as it was then (generation 1); caching
    that reply replaced the generation-2 copy the watch had delivered meanwhile, and the update
    handler's apply then worked from the stale copy."""

    async def run() -> None:
        r, api = await applied_reconciler()
        written = api.apply_model_status
        release = hold_status_writes(api)  # replies: generation 1, as when sent
        dep = copy.deepcopy(api.objects[("Deployment", "models", "smollm2")])
        r.observe_child("MODIFIED", dep | {"status": {"replicas": 1, "readyReplicas": 1}})
        await settle()  # that write is on its way
        changed = make_model({"model": {"uri": "pvc://weights"}, "runtime": {"maxNumSeqs": 8}})
        changed["metadata"]["generation"] = 2
        r.observe_model("MODIFIED", changed)
        release.set()
        await settle()
        api.apply_model_status = written  # type: ignore[method-assign]
        await r.apply(changed)
        await settle()
        args = api.objects[("Deployment", "models", "smollm2")]["spec"]["template"]["spec"]
        args = args["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == "8"
        assert api.statuses[-1]["observedGeneration"] == 2
        await r.close()

    asyncio.run(run())
