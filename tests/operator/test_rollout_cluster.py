"""A spec change on a 1-replica model while a client sends requests: no request fails.

The default rollout (maxSurge 1, maxUnavailable 0) starts the new pod, waits for it to be
Ready, and only then deletes the old one, which keeps serving through its shutdown delay and
drains what it has. The client finds ready, not terminating pods by selector before every
request (as the dev cluster's clients must: EndpointSlices never hold 127.x addresses) and never
retries. A random 2-layer Llama with SmolLM2's tokenizer loads in a second.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kubeinfer.devcluster.testing import DevClusterHandle, wait_for
from kubeinfer.operator.manifests import selector_string
from kubeinfer.runtime.loadgen import find_pod_urls
from kubeinfer.runtime.testing import llama_config, write_random_checkpoint
from tests.operator.test_operator_cluster import GROUP, PLURAL, VERSION, Cluster, operator_namespace

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

NAME = "rolled"
READY_TIMEOUT_S = 300  # pod start-up on a shared, busy 2-core machine
REQUEST_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def cluster(
    dev_cluster: DevClusterHandle, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    with operator_namespace(dev_cluster, "roll", tmp_path_factory.mktemp("rollout")) as c:
        yield c


@pytest.fixture(scope="module")
def tiny_model(smollm2_dir: Path) -> Iterator[Path]:
    # under kubeinfer's cache, never /tmp (see test_operator_cluster.weights_dir)
    cache = Path(os.environ.get("KUBEINFER_CACHE", Path.home() / ".cache" / "kubeinfer"))
    root = cache / "operator-tests" / f"r{time.time_ns()}"
    config_ = llama_config(vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=512)
    out = write_random_checkpoint(root / "tiny", config_)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out / name)
    yield out
    shutil.rmtree(root, ignore_errors=True)


def model_body(model_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceModel",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": f"hostpath://{model_dir}", "servedName": "tiny"},
            "runtime": {
                "dtype": "float32",
                "maxModelLen": 512,
                "maxNumSeqs": 16,
                "maxNumBatchedTokens": 512,
                "extraArgs": ["--device", "cpu", "--num-kv-blocks", "128"],
                # no C++ attention build per pod (its /tmp is the pod's own): minutes on a
                # busy 2-core machine, and a tiny model needs no fast kernel
                "env": [{"name": "KUBEINFER_CPU_KERNELS", "value": "0"}],
            },
            "resources": {"gpus": 0, "cpu": "100m", "memory": "1Gi"},
            "replicas": 1,
        },
    }


@dataclass
class Client:
    """Sends one completion at a time to a ready pod until stopped; records every outcome."""

    kubeconfig: Path
    namespace: str
    num_ok: int = 0
    failures: list[str] = field(default_factory=list)
    pods_served: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(REQUEST_TIMEOUT_S + 10)

    def _run(self) -> None:
        body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 8}
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
            i = 0
            while not self._stop.is_set():
                urls = find_pod_urls(selector_string(NAME), self.namespace,
                                     kubeconfig=self.kubeconfig)  # fmt: skip
                if not urls:
                    self.failures.append(f"{time.strftime('%X')}: no ready pod")
                    time.sleep(0.2)
                    continue
                url = urls[i % len(urls)]
                i += 1
                try:
                    resp = http.post(f"{url}/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    self.failures.append(f"{time.strftime('%X')} {url}: {exc!r}")
                    continue
                if resp.status_code == 200:
                    self.num_ok += 1
                    self.pods_served.add(url)
                else:
                    self.failures.append(f"{time.strftime('%X')} {url}: HTTP {resp.status_code}")


def test_a_spec_change_on_one_replica_fails_no_request(cluster: Cluster, tiny_model: Path) -> None:
    cluster.custom.create_namespaced_custom_object(
        GROUP, VERSION, cluster.ns, PLURAL, model_body(tiny_model)
    )
    cluster.wait_phase(NAME, "Ready", READY_TIMEOUT_S, readyReplicas=1)
    (old_pod,) = [p["metadata"]["name"] for p in cluster.pods(NAME)]
    client = Client(cluster.dev.kubeconfig, cluster.ns)
    client.start()
    try:
        wait_for(lambda: client.num_ok >= 3, timeout_s=60, what="requests served before")
        cluster.patch_model(NAME, {"spec": {"runtime": {"maxNumSeqs": 8}}})

        def rolled() -> bool:
            pods = cluster.pods(NAME)
            dep = cluster.get("Deployment", NAME) or {}
            return (
                [p["metadata"]["name"] for p in pods] != [old_pod]
                and old_pod not in {p["metadata"]["name"] for p in pods}
                and (dep.get("status") or {}).get("updatedReplicas") == 1
                and (dep.get("status") or {}).get("readyReplicas") == 1
            )

        try:
            wait_for(rolled, timeout_s=READY_TIMEOUT_S, what="the rollout to replace the old pod")
        except AssertionError as exc:
            pods = [(p["metadata"]["name"], p.get("status")) for p in cluster.pods(NAME)]
            dep = (cluster.get("Deployment", NAME) or {}).get("status")
            raise AssertionError(
                f"{exc}\npods: {pods}\ndeployment: {dep}\n{cluster.diagnostics()}"
            ) from None
        served = client.num_ok
        print(f"rollout: {served} requests served during it, failures {client.failures}")
        wait_for(lambda: client.num_ok >= served + 3, timeout_s=60, what="requests served after")
    finally:
        client.stop()
    assert client.failures == [], f"{client.num_ok} ok, failures: {client.failures[:10]}"
    assert len(client.pods_served) == 2  # the old pod and the new one both served
    status = cluster.wait_phase(NAME, "Ready", 60, readyReplicas=1)
    assert status["observedGeneration"] == cluster.model(NAME)["metadata"]["generation"]
