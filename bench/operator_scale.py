"""Operator at scale: 500 InferenceModels (replicas 0, autoscaling off) on the dev cluster.

Reports the time from the first create until every model's Deployment exists, the
create -> Deployment latency p50/p99 (creates return; a watch sees each Deployment appear),
the operator's peak RSS, and when every Service and status exists too (the operator defers
those until the Deployments are out). Baseline in the same run: the same 500 rendered Deployments
created directly by this script with as many client threads (the API server's own floor).
Goal (issue 6): <= 120 s in all, p50 <= 1 s, RSS <= 300 MB. Appends a row to RESULTS.md.

    .venv/bin/python bench/operator_scale.py [--num-models 500]

Uses the running dev cluster (`kubeinfer dev up`), or brings one up and down itself.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
from kubernetes import client, watch

from kubeinfer.devcluster.cluster import DevCluster
from kubeinfer.devcluster.testing import DevClusterHandle, _is_running, _make_handle
from kubeinfer.operator.manifests import GROUP, PLURAL, VERSION, render_deployment
from kubeinfer.operator.settings import OperatorSettings
from kubeinfer.operator.spec import parse_spec
from kubeinfer.operator.testing import OperatorProcess

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "crds" / "inferencemodels.kubeinfer.dev.yaml"
RESULTS = Path(__file__).with_name("RESULTS.md")
NUM_THREADS = 8


def model_body(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubeinfer.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": f"m{i:04d}"},
        "spec": {"model": {"uri": f"pvc://models/m{i:04d}"}, "replicas": 0},
    }


class DeploymentWatch(threading.Thread):
    """Records when each Deployment of a namespace is first seen."""

    def __init__(self, dev: DevClusterHandle, ns: str) -> None:
        super().__init__(daemon=True)
        self.apps = client.AppsV1Api(dev.api_client)
        self.ns = ns
        self.seen: dict[str, float] = {}
        self.stop_flag = threading.Event()
        self._w = watch.Watch()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                for event in self._w.stream(
                    self.apps.list_namespaced_deployment, self.ns, timeout_seconds=5
                ):
                    name = event["object"].metadata.name
                    self.seen.setdefault(name, time.monotonic())
                    if self.stop_flag.is_set():
                        break
            except Exception:  # noqa: BLE001 - a dropped stream restarts; stop() drops it too
                if self.stop_flag.is_set():
                    return

    def stop(self) -> None:
        self.stop_flag.set()
        self._w.stop()


class RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.peak = 0
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.wait(0.2):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return


def _apiserver_process(dev: DevClusterHandle) -> psutil.Process | None:
    """This cluster's kube-apiserver (other dev clusters may run beside it)."""
    cert_dir = f"--cert-dir={dev.cluster.layout.pki}"
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "kube-apiserver" and cert_dir in (proc.info["cmdline"] or []):
            return proc
    return None


def _cpu_s(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    times = proc.cpu_times()
    return float(times.user + times.system)


def wait_all(watcher: DeploymentWatch, names: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(n in watcher.seen for n in names):
        if time.monotonic() > deadline:
            missing = [n for n in names if n not in watcher.seen]
            raise SystemExit(f"{len(missing)} Deployments missing after {timeout_s:.0f}s")
        time.sleep(0.1)


def wait_settled(dev: DevClusterHandle, ns: str, names: list[str], timeout_s: float) -> None:
    """Until every model has its Service and a status phase: the writes the operator defers
    until the burst of Deployments is over."""
    custom, core = client.CustomObjectsApi(dev.api_client), client.CoreV1Api(dev.api_client)
    deadline = time.monotonic() + timeout_s
    while True:
        services = {s.metadata.name for s in core.list_namespaced_service(ns).items}
        models = custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
        phased = {m["metadata"]["name"] for m in models if (m.get("status") or {}).get("phase")}
        if services >= set(names) and phased >= set(names):
            return
        if time.monotonic() > deadline:
            raise SystemExit(
                f"after {timeout_s:.0f}s: {len(set(names) - services)} Services and "
                f"{len(set(names) - phased)} statuses missing (a dev cluster from before its "
                "service range was a /16 runs out of ClusterIPs: `kubeinfer dev down --purge`)"
            )
        time.sleep(0.5)


def run_creates(fn: Any, items: list[Any]) -> dict[str, float]:
    """Call fn on every item from NUM_THREADS threads; name -> monotonic time it returned."""
    done: dict[str, float] = {}

    def one(item: Any) -> None:
        name = fn(item)
        done[name] = time.monotonic()

    with ThreadPoolExecutor(NUM_THREADS) as pool:
        list(pool.map(one, items))
    return done


def measure(watcher: DeploymentWatch, created: dict[str, float], start: float) -> dict[str, float]:
    latencies = sorted(watcher.seen[n] - created[n] for n in created)
    return {
        "total_s": max(watcher.seen[n] for n in created) - start,
        "p50_s": statistics.median(latencies),
        "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def bench(dev: DevClusterHandle, num_models: int, log_dir: Path, *, record: bool) -> None:
    dev.kubectl("apply", "-f", str(CRD))
    dev.kubectl("wait", "--for=condition=established", "crd/inferencemodels.kubeinfer.dev")
    custom, apps = client.CustomObjectsApi(dev.api_client), client.AppsV1Api(dev.api_client)
    ns_op, ns_base = dev.namespace("bench-op"), dev.namespace("bench-base")
    names = [f"m{i:04d}" for i in range(num_models)]
    try:
        # baseline: the same Deployments, created directly
        watcher = DeploymentWatch(dev, ns_base)
        watcher.start()
        config = OperatorSettings()

        def create_deployment(i: int) -> str:
            body = model_body(i)
            body["metadata"].update(namespace=ns_base, uid="0")
            dep = render_deployment(body, parse_spec(body["spec"]), config)
            del dep["metadata"]["ownerReferences"]
            apps.create_namespaced_deployment(ns_base, dep)
            return str(body["metadata"]["name"])

        start = time.monotonic()
        created = run_creates(create_deployment, list(range(num_models)))
        wait_all(watcher, names, 300)
        base = measure(watcher, created, start)
        watcher.stop()

        op = OperatorProcess.start(dev.kubeconfig, [ns_op], log_dir / "operator.log")
        sampler = RssSampler(op.proc.pid)
        sampler.start()
        watcher = DeploymentWatch(dev, ns_op)
        watcher.start()
        time.sleep(1)
        idle_rss = sampler.peak

        def create_model(i: int) -> str:
            custom.create_namespaced_custom_object(
                "kubeinfer.dev", "v1alpha1", ns_op, "inferencemodels", model_body(i)
            )
            return f"m{i:04d}"

        apiserver = _apiserver_process(dev)
        cpu_before = (_cpu_s(sampler.proc), _cpu_s(apiserver))
        start = time.monotonic()
        created = run_creates(create_model, list(range(num_models)))
        wait_all(watcher, names, 600)
        ours = measure(watcher, created, start)
        op_cpu = _cpu_s(sampler.proc) - cpu_before[0]
        api_cpu = _cpu_s(apiserver) - cpu_before[1]
        wait_settled(dev, ns_op, names, 300)
        settled_s = time.monotonic() - start
        load = os.getloadavg()
        sampler.stop_flag.set()
        watcher.stop()
        peak_mb = sampler.peak / 2**20
        op.stop()
    finally:
        dev.delete_namespace(ns_op)
        dev.delete_namespace(ns_base)
    print(
        f"operator: all {num_models} Deployments in {ours['total_s']:.1f} s, "
        f"p50 {ours['p50_s'] * 1000:.0f} ms, p99 {ours['p99_s'] * 1000:.0f} ms, "
        f"peak RSS {peak_mb:.0f} MB (idle {idle_rss / 2**20:.0f} MB); CPU until then: "
        f"operator {op_cpu:.1f} s, kube-apiserver {api_cpu:.1f} s; every Service and status "
        f"in {settled_s:.1f} s; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    print(
        f"direct creates: {base['total_s']:.1f} s, p50 {base['p50_s'] * 1000:.0f} ms, "
        f"p99 {base['p99_s'] * 1000:.0f} ms"
    )
    goal = ours["total_s"] <= 120 and ours["p50_s"] <= 1 and peak_mb <= 300
    row = (
        f"| {dt.date.today().isoformat()} | operator_scale | {num_models} models, replicas 0, "
        f"{NUM_THREADS} client threads, dev cluster | all Deployments {ours['total_s']:.1f} s, "
        f"p50 {ours['p50_s'] * 1000:.0f} ms, p99 {ours['p99_s'] * 1000:.0f} ms, "
        f"RSS {peak_mb:.0f} MB, every Service and status {settled_s:.0f} s, "
        f"load {load[0]:.1f} | direct Deployment creates {base['total_s']:.1f} s, "
        f"p50 {base['p50_s'] * 1000:.0f} ms | time ratio {ours['total_s'] / base['total_s']:.2f} "
        f"(goal <= 120 s, p50 <= 1 s, RSS <= 300 MB: {'met' if goal else 'missed'}) |\n"
    )
    if record:
        with open(RESULTS, "a") as f:
            f.write(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-models", type=int, default=500)
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args()
    cluster = DevCluster.from_env()
    reused = cluster.layout.state_file.exists() and _is_running(cluster)
    if not reused:
        cluster.up()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bench(_make_handle(cluster), args.num_models, Path(tmp), record=not args.no_record)
    finally:
        if not reused:
            cluster.down()


if __name__ == "__main__":
    main()
