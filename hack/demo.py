"""`make demo`: the whole story on one machine.

Dev cluster up -> `helm install` the operator from helm/kubeinfer -> apply
examples/smollm2-scale-to-zero.yaml (autoscaling 0..2 replicas, short windows, the model's
router in front) -> the router is up and no replica runs -> a chat completion through the
official `openai` client at the router: the router holds it, the autoscaler scales 0 -> 1, the
answer comes after the cold start -> a bounded load burst with `kubeinfer loadgen` at the
router while a timeline (tokens/s, held/running/waiting, replicas) prints -> the router spreads
it over the replicas the autoscaler adds -> load stops -> scale-down back to 0 ->
demo-timeline.png, `kubectl get im` and the scaling events.

Environment: DEMO_KEEP=0 tears the cluster down at the end (default: leave it up);
KUBEINFER_DEV_DIR picks the dev cluster's state folder (default `.cache/demo`, apart from the
tests' `.cache/dev`); DEMO_PNG the plot's path. Every wait is
bounded; the whole run takes a few minutes and exits non-zero when any step fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kubeinfer.devcluster.cluster import DevCluster
from kubeinfer.devcluster.config import DevClusterError
from kubeinfer.operator.manifests import router_selector_string, selector_string
from kubeinfer.operator.testing import dev_hostpath_helm_args

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "kubeinfer"
EXAMPLE = REPO / "examples" / "smollm2-scale-to-zero.yaml"
MODEL_DIR = REPO / ".cache" / "models" / "smollm2-135m"
OPERATOR_NAMESPACE = "kubeinfer-system"
NAMESPACE = "default"
NAME = "smollm2-zero"
SELECTOR = selector_string(NAME)
ROUTER_SELECTOR = router_selector_string(NAME)
QUESTION = "What is the capital of France?"

T = TypeVar("T")


class DemoError(Exception):
    """A demo step failed; the message says which and why."""


def say(text: str) -> None:
    print(text, flush=True)


@contextmanager
def step(title: str) -> Iterator[None]:
    say(f"\n==> {title}")
    start = time.monotonic()
    yield
    say(f"    done in {time.monotonic() - start:.1f}s")


def wait_for(check: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 2.0,
             report: Callable[[], str] | None = None) -> T:
    """Poll `check` until it returns something truthy; DemoError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last_report = ""
    while True:
        try:
            value = check()
        except Exception as exc:  # noqa: BLE001 - a transient error while waiting
            value, last_report = None, f"{type(exc).__name__}: {exc}"
        if value:
            return value
        if report is not None:
            line = report()
            if line != last_report:
                say(f"    {line}")
                last_report = line
        if time.monotonic() > deadline:
            raise DemoError(f"timed out after {timeout_s:.0f}s waiting for {what} ({last_report})")
        time.sleep(every_s)


@dataclass
class Cluster:
    dev: DevCluster
    env: dict[str, str] = field(default_factory=dict)

    @property
    def bin(self) -> Path:
        return self.dev.bin_dir

    def run(self, tool: str, *args: str, stdin: str | None = None, timeout_s: float = 120,
            check: bool = True) -> str:
        cmd = [str(self.bin / tool), "--kubeconfig", str(self.dev.kubeconfig), *args]
        done = subprocess.run(cmd, input=stdin, capture_output=True, text=True,
                              timeout=timeout_s, env={**os.environ, **self.env})
        if check and done.returncode != 0:
            raise DemoError(f"{tool} {' '.join(args)} failed ({done.returncode}): "
                            f"{(done.stderr or done.stdout).strip()[-2000:]}")
        return done.stdout

    def kubectl(self, *args: str, **kw: Any) -> str:
        return self.run("kubectl", *args, **kw)

    def model(self) -> dict[str, Any]:
        return json.loads(self.kubectl("get", "im", NAME, "-n", NAMESPACE, "-o", "json"))

    def pod_urls(self) -> list[str]:
        """The model's ready runtime pods (127.x IPs on the dev cluster)."""
        from kubeinfer.runtime.loadgen import find_pod_urls

        return find_pod_urls(SELECTOR, NAMESPACE, kubeconfig=self.dev.kubeconfig)

    def router_urls(self) -> list[str]:
        """The model's ready router pods: the endpoint every client here talks to (the
        Service's ClusterIP is not reachable from this machine)."""
        from kubeinfer.runtime.loadgen import find_pod_urls

        return find_pod_urls(ROUTER_SELECTOR, NAMESPACE, kubeconfig=self.dev.kubeconfig)


def example_manifest(model_dir: Path) -> str:
    """examples/smollm2.yaml with the model's real path (resolved: not a symlink)."""
    return EXAMPLE.read_text().replace("MODEL_DIR", str(model_dir.resolve()))


# --- steps ----------------------------------------------------------------------------------


def state_dir() -> Path:
    """The demo's own cluster (`.cache/demo`), so its operator, installed for every namespace,
    never meets the operators of the tests' cluster in `.cache/dev`; KUBEINFER_DEV_DIR wins."""
    return Path(os.environ.get("KUBEINFER_DEV_DIR") or REPO / ".cache" / "demo").resolve()


def start_cluster() -> Cluster:
    with step(f"dev cluster (kubeinfer dev up --state-dir {state_dir()})"):
        dev = DevCluster.from_env(state_dir())
        try:
            dev.up(progress=lambda line: say(f"    {line}"))
        except DevClusterError as exc:
            raise DemoError(f"dev cluster did not come up: {exc}") from exc
    return Cluster(dev)


def install_operator(cluster: Cluster) -> None:
    with step(f"helm install kubeinfer {CHART.relative_to(REPO)}"):
        out = cluster.run(
            "helm", "upgrade", "--install", "kubeinfer", str(CHART),
            "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
            *dev_hostpath_helm_args(),  # the example's weights come through hostpath://
            "--wait", "--timeout", "4m", timeout_s=300,
        )  # fmt: skip
        say("    " + "\n    ".join(line for line in out.splitlines()[:6]))


def apply_model(cluster: Cluster) -> None:
    with step(f"kubectl apply -f {EXAMPLE.relative_to(REPO)}"):
        if not (MODEL_DIR / "model.safetensors").exists():
            raise DemoError(f"{MODEL_DIR} is missing: run `make model`")
        say("    " + cluster.kubectl("apply", "-f", "-", stdin=example_manifest(MODEL_DIR)).strip())

        def idle() -> list[str] | None:
            model = cluster.model()
            status = model.get("status", {})
            if status.get("phase") == "Failed":
                raise DemoError(f"the model failed: {_conditions(status)}")
            if model["spec"].get("replicas") != 0 or status.get("replicas", 0) != 0:
                return None  # the example starts at 0: the autoscaler has not moved yet
            return cluster.router_urls()

        def report() -> str:
            status = cluster.model().get("status", {})
            return f"phase {status.get('phase', '-')}: {_conditions(status)}"

        (url, *_) = wait_for(idle, timeout_s=300, what="a ready router", report=report)
        if cluster.pod_urls():
            raise DemoError("a replica runs before any request (the example asks for 0)")
        status = cluster.model().get("status", {})
        say(f"    router ready at {url}; replicas {status.get('replicas', 0)}, phase "
            f"{status.get('phase')} ({_conditions(status)})")


def _conditions(status: dict[str, Any]) -> str:
    return "; ".join(
        f"{c['type']}={c['status']} {c.get('reason', '')}: {c.get('message', '')}"[:160]
        for c in status.get("conditions", [])
        if c["type"] in ("Ready", "Degraded")
    )


def chat(cluster: Cluster) -> str:
    from openai import OpenAI

    with step(f"chat completion with the openai client at the router, 0 replicas: {QUESTION!r}"):
        (url, *_) = wait_for(cluster.router_urls, 60, "a ready router pod")
        # no retries: the router holds the request through the cold start, so one call answers
        client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300, max_retries=0)
        served = cluster.model()["spec"]["model"].get("servedName", NAME)
        started = time.monotonic()
        reply = client.chat.completions.create(
            model=served, messages=[{"role": "user", "content": QUESTION}],
            max_tokens=32, temperature=0.0,
        )  # fmt: skip
        answer = (reply.choices[0].message.content or "").strip()
        say(f"    answer: {answer}")
        say(f"    cold start: answered {time.monotonic() - started:.1f}s after the request "
            "(held at the router, 0 -> 1 replica, weights loaded, generated)")
        if not answer:
            raise DemoError("the model answered with an empty message")
    return answer


@dataclass
class Sample:
    t: float
    load: int
    tokens_per_s: float
    held: float
    running: float
    waiting: float
    replicas: int
    ready: int


class Load:
    """`num_procs` `kubeinfer loadgen` processes at the model's router, `per_proc` clients each,
    started again as they end, until stopped; the router spreads them over whichever replicas
    are ready. Each round is a few short requests, so the load ends soon after `stop`."""

    def __init__(self, cluster: Cluster, per_proc: int, num_procs: int) -> None:
        self.cluster = cluster
        self.per_proc = per_proc
        self.num_procs = num_procs
        self.stopped = threading.Event()
        self.rounds: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._procs: dict[int, subprocess.Popen[str]] = {}
        self.urls: list[str] = []  # the ready routers, listed every 2 s while the load runs
        self.pod_urls: list[str] = []  # the ready replicas, for the timeline's scrape
        self._lock = threading.Lock()
        self._seed = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """No new rounds; the ones in flight finish on their own (see `clients`)."""
        self.stopped.set()

    def clients(self) -> int:
        """Requests the load holds open now (loadgen processes still running x clients)."""
        with self._lock:
            self._reap()
            return len(self._procs) * self.per_proc

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.clients() and time.monotonic() < deadline:
            time.sleep(0.5)
        with self._lock:
            for proc in self._procs.values():
                proc.kill()
            self._reap()

    def _reap(self) -> None:
        for slot, proc in list(self._procs.items()):
            if proc.poll() is None:
                continue
            out, err = proc.communicate()
            del self._procs[slot]
            if proc.returncode == 0:
                self.rounds.append(json.loads(out))
            else:
                self.errors.append((err or out).strip()[-300:])

    def _launch(self, slot: int, url: str) -> None:
        self._seed += 1
        cmd = [
            str(REPO / ".venv" / "bin" / "kubeinfer"), "loadgen", "--url", url,
            "--num-requests", str(self.per_proc), "--concurrency", str(self.per_proc),
            "--seed", str(self._seed), "--prompt-len", "16:64", "--output-len", "16:32",
            "--timeout", "30", "--json",
        ]  # fmt: skip
        self._procs[slot] = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def _loop(self) -> None:
        listed_at = 0.0
        while not self.stopped.is_set():
            if time.monotonic() - listed_at >= 2.0:  # the pods change slowly; reaping does not
                listed_at = time.monotonic()
                try:
                    self.urls = self.cluster.router_urls()
                    self.pod_urls = self.cluster.pod_urls()
                except Exception as exc:  # noqa: BLE001 - the API may blink; try again
                    self.errors.append(f"listing pods: {exc}")
            with self._lock:
                self._reap()
                for slot in range(self.num_procs if self.urls else 0):
                    if slot not in self._procs and not self.stopped.is_set():
                        self._launch(slot, self.urls[slot % len(self.urls)])
            time.sleep(0.5)


def scrape(urls: list[str], names: tuple[str, ...]) -> list[float]:
    """Each of `names` summed over the pods' /metrics (a pod that does not answer adds 0)."""
    sums = dict.fromkeys(names, 0.0)
    for url in urls:
        try:
            text = httpx.get(f"{url}/metrics", timeout=2.0).text
        except httpx.HTTPError:
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in sums:
                    sums[sample.name] += sample.value
    return list(sums.values())


def sample(cluster: Cluster, load: Load, t0: float) -> Sample:
    status = cluster.model().get("status", {})
    if load.stopped.is_set():  # the load's thread lists the pods no more
        load.urls, load.pod_urls = cluster.router_urls(), cluster.pod_urls()
    (held,) = scrape(load.urls, ("kubeinfer_router_held_requests",))
    running, waiting = scrape(
        load.pod_urls, ("vllm:num_requests_running", "vllm:num_requests_waiting")
    )
    return Sample(
        t=time.monotonic() - t0,
        load=load.clients(),
        tokens_per_s=float(status.get("metrics", {}).get("generationTokensPerSecond", 0.0)),
        held=held, running=running, waiting=waiting,
        replicas=int(status.get("replicas", 0)), ready=int(status.get("readyReplicas", 0)),
    )  # fmt: skip


def burst(cluster: Cluster, *, clients: int, min_load_s: float, max_load_s: float,
          settle_s: float) -> list[Sample]:
    """Load at the router until the model has scaled up (at least `min_load_s`, at most
    `max_load_s`), then no load until it is back at zero replicas (at most `settle_s`); a
    sample every 2 s."""
    spec = cluster.model()["spec"]["autoscaling"]
    say(f"    autoscaling: {spec['metric']} target {spec['targetPerReplica']} per replica, "
        f"{spec['minReplicas']}..{spec['maxReplicas']} replicas, scale-down after "
        f"{spec['scaleDownDelaySeconds']} s, to zero after "
        f"{spec['scaleToZeroAfterSeconds']} s without a request")
    say(f"    load: {clients} streamed completions at a time at the router "
        "(kubeinfer loadgen --url ROUTER), tokens/s as the autoscaler saw it")
    say(f"    {'t':>5}  {'load':>4}  {'tokens/s':>8}  {'held':>4}  {'running':>7}  "
        f"{'waiting':>7}  {'replicas':>8}  {'ready':>5}")
    samples: list[Sample] = []
    load = Load(cluster, per_proc=clients // 2, num_procs=2)
    t0 = time.monotonic()

    def record() -> Sample:
        s = sample(cluster, load, t0)
        samples.append(s)
        say(f"    {s.t:5.0f}  {s.load:4d}  {s.tokens_per_s:8.1f}  {s.held:4.0f}  "
            f"{s.running:7.0f}  {s.waiting:7.0f}  {s.replicas:8d}  {s.ready:5d}")
        return s

    load.start()
    try:
        while True:
            s = record()
            if s.t >= min_load_s and max(x.ready for x in samples) > 1:
                break
            if s.t >= max_load_s:
                raise DemoError(f"no scale-up after {max_load_s:.0f}s of load "
                                f"(loadgen errors: {load.errors[-2:]})")
            time.sleep(2)
    finally:
        say("    -- stopping the load --")
        load.stop()
    stop_t = time.monotonic()
    try:
        while True:
            s = record()
            if s.replicas == 0 and s.ready == 0 and s.load == 0:
                break
            if time.monotonic() - stop_t > settle_s:
                raise DemoError(f"not back at 0 replicas {settle_s:.0f}s after the load stopped")
            time.sleep(2)
    finally:
        load.wait(timeout_s=30)
    tokens = sum(r["output_tokens"] for r in load.rounds)
    say(f"    load: {len(load.rounds)} loadgen runs, "
        f"{sum(r['num_ok'] for r in load.rounds)} requests ok, {tokens} tokens generated, "
        f"{len(load.errors)} failed runs")
    if load.errors:
        say(f"    last loadgen error: {load.errors[-1]}")
    return samples


def plot(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    t = [s.t for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    axes[0].step(t, [s.load for s in samples], where="post", color="tab:gray", label="clients")
    axes[0].step(t, [s.held for s in samples], where="post", color="tab:red", label="held")
    axes[0].set_ylabel("load (requests)")
    axes[0].legend(loc="upper right")
    axes[1].plot(t, [s.tokens_per_s for s in samples], color="tab:blue")
    axes[1].set_ylabel("tokens/s")
    axes[2].step(t, [s.replicas for s in samples], where="post", label="replicas")
    axes[2].step(t, [s.ready for s in samples], where="post", label="ready", linestyle="--")
    axes[2].set_ylabel("replicas")
    axes[2].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[2].set_xlabel("seconds")
    axes[2].legend(loc="upper right")
    fig.suptitle("kubeinfer demo: SmolLM2 on the dev cluster")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def report(cluster: Cluster) -> None:
    with step("kubectl get im; the scaling events"):
        say(cluster.kubectl("get", "im", "-n", NAMESPACE).rstrip())
        events = cluster.kubectl(
            "get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp",
            "--field-selector", f"involvedObject.kind=InferenceModel,involvedObject.name={NAME}",
            "-o", "custom-columns=TIME:.lastTimestamp,REASON:.reason,MESSAGE:.message",
        )  # fmt: skip
        say(events.rstrip())
        history = cluster.model().get("status", {}).get("scalingHistory", [])
        for entry in history:
            say(f"    {entry.get('time')}: {entry.get('from')} -> {entry.get('to')}: "
                f"{entry.get('reason')}")


def main() -> int:
    keep = os.environ.get("DEMO_KEEP", "1") not in ("0", "false", "no")
    png = Path(os.environ.get("DEMO_PNG", REPO / "demo-timeline.png"))
    started = time.monotonic()
    cluster: Cluster | None = None
    ok = False
    try:
        if not (CHART / "Chart.yaml").exists():
            raise DemoError(f"{CHART} is missing")
        cluster = start_cluster()
        install_operator(cluster)
        apply_model(cluster)
        chat(cluster)
        with step("load burst through the router (the autoscaler scales up, then to zero)"):
            samples = burst(cluster, clients=12, min_load_s=45, max_load_s=200, settle_s=240)
            peak = max(s.ready for s in samples)
            say(f"    replicas: 0 -> 1 (cold start) -> {peak} (ready) -> {samples[-1].ready}")
        with step(f"timeline plot -> {png}"):
            plot(samples, png)
            say(f"    wrote {png} ({png.stat().st_size} bytes)")
        report(cluster)
        ok = True
    except (DemoError, subprocess.TimeoutExpired, OSError, yaml.YAMLError) as exc:
        say(f"\ndemo FAILED: {exc}")
        if cluster is not None:
            say(f"    logs: {cluster.dev.layout.root}/logs and {cluster.dev.layout.root}/pods")
        return 1
    finally:
        if cluster is not None and not keep:
            with step("kubeinfer dev down (DEMO_KEEP=0)"):
                # a failed run keeps its state folder (the logs) for a look
                cluster.dev.down(purge=ok, progress=lambda line: say(f"    {line}"))
    say(f"\ndemo OK in {time.monotonic() - started:.0f}s")
    if keep:
        where = f"--state-dir {state_dir()}"
        say(f"The cluster is still up: export KUBECONFIG={state_dir() / 'kubeconfig'}; then "
            f"{cluster.bin if cluster else ''}/kubectl get im; stop it with "
            f"`.venv/bin/kubeinfer dev down {where}`.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
