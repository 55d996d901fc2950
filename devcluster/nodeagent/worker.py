"""One thread per pod bound to our nodes: prepare it (IP, token, kubeconfig, volumes), run its
init containers then its containers, probe them, restart them per restartPolicy, write the pod
status, and on deletion stop the processes (SIGTERM, grace period, SIGKILL) and remove the pod.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from kubeinfer.devcluster.config import AgentConfig
from kubeinfer.devcluster.credentials import render_kubeconfig, write_kubeconfig
from kubeinfer.devcluster.nodeagent import podstatus
from kubeinfer.devcluster.nodeagent.container import (
    ContainerRun,
    RestartPolicy,
    backoff_delay,
    now_iso,
    should_restart,
)
from kubeinfer.devcluster.nodeagent.ipam import Ipam
from kubeinfer.devcluster.nodeagent.kube import Kube
from kubeinfer.devcluster.nodeagent.podspec import (
    LaunchSpec,
    PodContext,
    PodSpecError,
    launch_spec,
)
from kubeinfer.devcluster.nodeagent.probes import run_probe
from kubeinfer.devcluster.nodeagent.volumes import prepare_volumes

logger = logging.getLogger(__name__)

TICK_S = 0.25
HOST_IP = "127.0.0.1"
#: On agent shutdown (dev down) pods get at most this long to exit after SIGTERM.
SHUTDOWN_GRACE_S = 10.0


@dataclass(slots=True)
class AgentContext:
    config: AgentConfig
    kube: Kube
    ipam: Ipam


class PodWorker(threading.Thread):
    def __init__(self, pod: dict[str, Any], ctx: AgentContext) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.ctx = ctx
        self.uid: str = meta["uid"]
        self.key = f"{meta['namespace']}_{meta['name']}"
        self._pod = pod
        self._lock = threading.Lock()
        self._vanished = threading.Event()
        self._shutting_down = threading.Event()
        self.pod_dir = ctx.config.state_dir / "run" / self.uid
        self.pod_ip = ""
        self.start_time = now_iso()
        self.specs: dict[str, LaunchSpec] = {}
        self.runs: list[ContainerRun] = []
        self.init_runs: list[ContainerRun] = []
        self.num_init_done = 0
        self.init_failed = False
        self.refused: PodSpecError | None = None
        self.conditions: list[dict[str, Any]] = []
        self.last_status = ""
        self.token_issued_at = 0.0

    # --- called from the agent's watch thread -----------------------------------------------

    def update(self, pod: dict[str, Any]) -> None:
        with self._lock:
            self._pod = pod

    def vanish(self) -> None:
        """The pod object is gone (force-deleted): stop at once, write nothing."""
        self._vanished.set()

    def shutdown(self) -> None:
        """The agent is stopping: stop the processes, leave the pod object as it is."""
        self._shutting_down.set()

    @property
    def pod(self) -> dict[str, Any]:
        with self._lock:
            return self._pod

    # --- the pod's life ---------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._prepare()
            while not (self._vanished.is_set() or self._shutting_down.is_set()):
                pod = self.pod
                if pod["metadata"].get("deletionTimestamp"):
                    self._finish_deletion(pod)
                    return
                if self.refused is None:
                    self._step(pod)
                self._write_status(pod)
                time.sleep(TICK_S)
            self._stop_all(SHUTDOWN_GRACE_S if self._shutting_down.is_set() else 2.0)
            if self._vanished.is_set():
                self._cleanup()
        except Exception:
            logger.exception("pod %s: worker failed", self.key)
            self._stop_all(2.0)
        finally:
            self.ctx.ipam.release(self.uid)

    def _prepare(self) -> None:
        pod, cfg = self.pod, self.ctx.config
        self.pod_ip = self.ctx.ipam.allocate(self.uid, (pod.get("status") or {}).get("podIP"))
        self.pod_dir.mkdir(parents=True, exist_ok=True)
        cfg.pods_dir.mkdir(parents=True, exist_ok=True)
        previous = {s["name"]: s for s in (pod.get("status") or {}).get("containerStatuses") or []}
        for kind, containers in (
            ("init", pod["spec"].get("initContainers") or []),
            ("main", pod["spec"]["containers"]),
        ):
            for c in containers:
                run = ContainerRun(
                    name=c["name"],
                    image=c.get("image", ""),
                    log_path=cfg.pods_dir / f"{self.key}_{c['name']}.log",
                    pids_dir=cfg.container_pids_dir,
                    pod_key=self.key,
                    restart_count=int(previous.get(c["name"], {}).get("restartCount") or 0),
                )
                (self.init_runs if kind == "init" else self.runs).append(run)
        try:
            token = self._refresh_token(pod)
            pod_ctx = self._pod_context(pod)
            prepare_volumes(pod, pod_ctx, self.ctx.kube.lookup, token)
            for c in [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]:
                self.specs[c["name"]] = launch_spec(
                    pod, c, pod_ctx, cfg.images, self.ctx.kube.lookup
                )
        except PodSpecError as exc:
            self.refused = exc
            for run in [*self.init_runs, *self.runs]:
                run.waiting = (exc.reason, exc.message)
            logger.warning("pod %s refused: %s", self.key, exc.message)
            self.ctx.kube.event(pod, "Warning", "Failed", exc.message)

    def _pod_context(self, pod: dict[str, Any]) -> PodContext:
        cfg = self.ctx.config
        automount = pod["spec"].get("automountServiceAccountToken")
        return PodContext(
            pod_ip=self.pod_ip,
            host_ip=HOST_IP,
            api_host=cfg.api_host,
            api_port=cfg.api_port,
            pod_dir=self.pod_dir,
            kubeconfig=None if automount is False else self.pod_dir / "kubeconfig",
            venv_bin=cfg.venv_bin,
        )

    def _refresh_token(self, pod: dict[str, Any]) -> str:
        """A fresh token for the pod's service account, written into the pod's kubeconfig."""
        cfg = self.ctx.config
        try:
            token = self.ctx.kube.service_account_token(pod, cfg.token_ttl_s)
        except ApiException as exc:
            raise PodSpecError(
                "CreateContainerConfigError",
                f"token request for service account "
                f"{pod['spec'].get('serviceAccountName') or 'default'!r} failed: {exc.reason}",
            ) from exc
        self.token_issued_at = time.monotonic()
        write_kubeconfig(
            self.pod_dir / "kubeconfig",
            render_kubeconfig(
                server=f"https://{cfg.api_host}:{cfg.api_port}",
                ca_file=cfg.ca_file,
                token=token,
                user=f"system:serviceaccount:{pod['metadata']['namespace']}:"
                f"{pod['spec'].get('serviceAccountName') or 'default'}",
                namespace=pod["metadata"]["namespace"],
            ),
        )
        return token

    # --- one tick ---------------------------------------------------------------------------

    def _step(self, pod: dict[str, Any]) -> None:
        if time.monotonic() - self.token_issued_at > 0.8 * self.ctx.config.token_ttl_s:
            try:
                self._refresh_token(pod)
            except PodSpecError as exc:
                logger.warning("pod %s: %s", self.key, exc.message)
        policy: RestartPolicy = pod["spec"].get("restartPolicy") or "Always"
        if self.num_init_done < len(self.init_runs):
            if not self.init_failed:
                self._step_init(pod, policy)
            return
        for run in self.runs:
            self._step_container(pod, run, policy)

    def _step_init(self, pod: dict[str, Any], policy: RestartPolicy) -> None:
        run = self.init_runs[self.num_init_done]
        init_policy: RestartPolicy = "Never" if policy == "Never" else "OnFailure"
        self._step_container(pod, run, init_policy)
        if run.terminated is not None and not run.is_running:
            if run.terminated.exit_code == 0:
                self.num_init_done += 1
            elif init_policy == "Never":
                self.init_failed = True

    def _step_container(
        self, pod: dict[str, Any], run: ContainerRun, policy: RestartPolicy
    ) -> None:
        now = time.monotonic()
        container = self._container(pod, run.name)
        if run.is_running:
            ended = run.poll()
            if ended is not None:
                self._after_exit(pod, run, policy)
            else:
                self._probe(pod, run, container, policy)
            return
        if run.terminated is not None:
            return  # finished for good (restartPolicy said so)
        if run.started_at is None or now >= run.next_start_at:
            try:
                run.start(self.specs[run.name], container)
            except OSError as exc:
                run.waiting = (
                    "RunContainerError",
                    f"cannot start {self.specs[run.name].argv[0]!r}: {exc}",
                )
                run.started_at = run.started_at or now_iso()
                run.num_crashes += 1
                run.next_start_at = now + backoff_delay(
                    run.num_crashes,
                    self.ctx.config.restart_backoff_base_s,
                    self.ctx.config.restart_backoff_max_s,
                )
                self.ctx.kube.event(pod, "Warning", "Failed", run.waiting[1])

    def _after_exit(self, pod: dict[str, Any], run: ContainerRun, policy: RestartPolicy) -> None:
        ended = run.terminated
        assert ended is not None
        if not should_restart(policy, ended.exit_code):
            return
        cfg, now = self.ctx.config, time.monotonic()
        if now - run.started_monotonic > cfg.restart_backoff_reset_s:
            run.num_crashes = 0
        run.num_crashes += 1
        delay = backoff_delay(
            run.num_crashes, cfg.restart_backoff_base_s, cfg.restart_backoff_max_s
        )
        run.next_start_at = now + delay
        run.last_terminated, run.terminated = ended, None
        meta = pod["metadata"]
        run.waiting = (
            "CrashLoopBackOff",
            f"back-off {delay:.0f}s restarting failed container={run.name} "
            f"pod={meta['name']}_{meta['namespace']}({meta['uid']})",
        )
        if ended.exit_code != 0:
            self.ctx.kube.event(
                pod, "Warning", "BackOff", f"Back-off restarting failed container {run.name}"
            )

    def _probe(
        self,
        pod: dict[str, Any],
        run: ContainerRun,
        container: dict[str, Any],
        policy: RestartPolicy,
    ) -> None:
        startup = run.probes.get("startup")
        is_started = startup is None or (startup.has_result and startup.is_success)
        spec = self.specs[run.name]
        for kind in ("startup", "liveness", "readiness"):
            tracker = run.probes.get(kind)  # type: ignore[call-overload]
            if tracker is None or (kind == "startup") == is_started:
                continue
            if not tracker.is_due(time.monotonic()):
                continue
            result = run_probe(
                tracker.spec,
                container=container,
                pod_ip=self.pod_ip,
                env=spec.env,
                cwd=spec.cwd,
                timeout_s=tracker.timeout_s,
            )
            tracker.record(result, time.monotonic())
            if not result.is_success:
                self.ctx.kube.event(
                    pod,
                    "Warning",
                    "Unhealthy",
                    f"{kind.capitalize()} probe failed: {result.message}",
                )
            if kind in ("startup", "liveness") and tracker.has_failed:
                self.ctx.kube.event(
                    pod,
                    "Normal",
                    "Killing",
                    f"Container {run.name} failed {kind} probe, will be restarted",
                )
                run.kill(self._grace_s(pod), reason="Error")
                self._after_exit(pod, run, policy)
                return

    # --- status -----------------------------------------------------------------------------

    def _write_status(self, pod: dict[str, Any]) -> None:
        runs = self.runs
        is_initialized = self.num_init_done >= len(self.init_runs)
        all_started_once = all(r.started_at is not None for r in runs)
        if self.init_failed:
            phase: podstatus.Phase = "Failed"
        else:
            phase = podstatus.pod_phase(
                is_initialized=is_initialized and all_started_once and self.refused is None,
                num_running=sum(r.is_running for r in runs),
                num_restarting=sum(1 for r in runs if not r.is_running and r.terminated is None),
                exit_codes=[r.terminated.exit_code if r.terminated else None for r in runs],
            )
        self.conditions = podstatus.conditions(
            self.conditions or (pod.get("status") or {}).get("conditions") or [],
            is_initialized=is_initialized,
            are_containers_ready=bool(runs) and all(r.is_ready for r in runs),
            has_sandbox=True,
            now=now_iso(),
        )
        status = podstatus.pod_status(
            phase=phase,
            conditions=self.conditions,
            pod_ip=self.pod_ip,
            host_ip=HOST_IP,
            start_time=self.start_time,
            container_statuses=[r.to_api() for r in runs],
            init_container_statuses=[r.to_api() for r in self.init_runs],
        )
        encoded = json.dumps(status, sort_keys=True)
        if encoded == self.last_status:
            return
        meta = pod["metadata"]
        try:
            self.ctx.kube.patch_pod_status(meta["namespace"], meta["name"], status)
            self.last_status = encoded
        except ApiException as exc:
            if exc.status == 404:
                self._vanished.set()
            else:
                logger.warning("pod %s: status write failed: %s", self.key, exc.reason)

    # --- ending -----------------------------------------------------------------------------

    def _grace_s(self, pod: dict[str, Any]) -> float:
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is None:
            grace = pod["spec"].get("terminationGracePeriodSeconds")
        return float(30 if grace is None else grace)

    def _stop_all(self, grace_s: float) -> None:
        """SIGTERM every running container at once, then give them `grace_s` together."""
        from kubeinfer.devcluster import processes

        running = [r for r in [*self.init_runs, *self.runs] if r.is_running and r.record]
        for run in running:
            assert run.record is not None
            processes.terminate_group(run.record)
        deadline = time.monotonic() + grace_s
        for run in running:
            run.kill(max(0.1, deadline - time.monotonic()))

    def _finish_deletion(self, pod: dict[str, Any]) -> None:
        grace = self._grace_s(pod)
        logger.info("pod %s: deleting (grace %.0fs)", self.key, grace)
        self._stop_all(grace)
        self._write_status(pod)
        meta = pod["metadata"]
        try:
            self.ctx.kube.delete_pod_now(meta["namespace"], meta["name"], self.uid)
        except ApiException as exc:
            logger.warning("pod %s: final delete failed: %s", self.key, exc.reason)
        self._cleanup()

    def _cleanup(self) -> None:
        shutil.rmtree(self.pod_dir, ignore_errors=True)

    @staticmethod
    def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
        for c in [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]:
            if c["name"] == name:
                return c  # type: ignore[no-any-return]
        raise KeyError(name)
