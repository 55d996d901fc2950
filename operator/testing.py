"""Test and benchmark support: the operator as a subprocess against the dev cluster.

`OperatorProcess.start(kubeconfig, namespaces, log)` runs `kubeinfer operator run` with its
liveness and metrics endpoints on free loopback ports and waits until kopf's /healthz answers;
hostpath:// models are allowed under the dev prefixes (`dev_hostpath_env`), as on the dev
cluster; `stop()` sends SIGTERM (SIGKILL after a bound) and `kill()` SIGKILLs it, as a crash would.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dev_hostpath_prefixes() -> list[str]:
    """Where the tests, the benchmark and the demo keep weights for hostpath:// models:
    kubeinfer's cache (`KUBEINFER_CACHE`) and the checkout's `.cache` (models are linked there
    from the cache, so both spellings of a path are allowed)."""
    cache = Path(os.environ.get("KUBEINFER_CACHE", Path.home() / ".cache" / "kubeinfer"))
    checkout = Path(__file__).resolve().parents[1] / ".cache"
    return sorted({str(cache.resolve()), str(checkout)})


def dev_hostpath_env() -> dict[str, str]:
    """The operator's env that allows hostpath:// models under `dev_hostpath_prefixes()`."""
    return {
        "KUBEINFER_OPERATOR_ALLOW_HOSTPATH": "true",
        "KUBEINFER_OPERATOR_HOSTPATH_PREFIXES": ",".join(dev_hostpath_prefixes()),
    }


def dev_hostpath_helm_args() -> list[str]:
    """The same for `helm install` of the chart."""
    prefixes = ",".join(dev_hostpath_prefixes())
    return [
        "--set", "runtime.hostPath.enabled=true",
        "--set", f"runtime.hostPath.prefixes={{{prefixes}}}",
    ]  # fmt: skip


class OperatorStartError(RuntimeError):
    """The operator did not report healthy in time (the message has its log's tail)."""


@dataclass
class OperatorProcess:
    proc: subprocess.Popen[bytes]
    log: Path
    liveness_port: int
    metrics_port: int

    @classmethod
    def start(
        cls,
        kubeconfig: Path,
        namespaces: list[str],
        log: Path,
        *,
        extra_env: dict[str, str] | None = None,
        timeout_s: float = 60,
    ) -> OperatorProcess:
        liveness, metrics = free_port(), free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "KUBEINFER_OPERATOR_NAMESPACES": ",".join(namespaces),
            "KUBEINFER_OPERATOR_LIVENESS_HOST": "127.0.0.1",
            "KUBEINFER_OPERATOR_LIVENESS_PORT": str(liveness),
            "KUBEINFER_OPERATOR_METRICS_HOST": "127.0.0.1",
            "KUBEINFER_OPERATOR_METRICS_PORT": str(metrics),
            "KUBEINFER_OPERATOR_POD_PROBE_INTERVAL_S": "2",
            **dev_hostpath_env(),
            **(extra_env or {}),
        }
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kubeinfer", "operator", "run"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        op = cls(proc, log, liveness, metrics)
        op.wait_healthy(timeout_s)
        return op

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise OperatorStartError(f"operator exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.healthz_url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise OperatorStartError(f"operator not healthy in {timeout_s:.0f}s: {self.tail()}")

    @property
    def healthz_url(self) -> str:
        return f"http://127.0.0.1:{self.liveness_port}/healthz"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def tail(self, num_chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:] if self.log.exists() else ""

    def stop(self, timeout_s: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
