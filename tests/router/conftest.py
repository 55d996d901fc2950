"""Routers under test: `kubeinfer router` subprocesses on 127.0.0.1 in front of real
`kubeinfer serve` subprocesses of a tiny chat model (free ports, bounded waits)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.runtime.server.conftest import (
    Server,
    free_port,
    make_tiny_chat_model,
    start_server,
    stop_server,
)


@dataclass
class Router:
    proc: subprocess.Popen
    url: str
    log: Path
    backends_file: Path

    def set_backends(self, *urls: str) -> None:
        tmp = self.backends_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{u}\n" for u in urls))
        tmp.replace(self.backends_file)  # atomic: the router never reads half a file

    def metrics(self) -> dict[str, float]:
        """Samples of the router's /metrics, name{labels} -> value."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics").text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_pods(self, num_pods: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.url}/ready").json()["num_pods"] != num_pods:
            assert time.monotonic() < deadline, f"router never saw {num_pods} pods"
            time.sleep(0.05)


def start_router(tmp: Path, *urls: str, args: tuple[str, ...] = (), timeout: float = 60) -> Router:
    port = free_port()
    backends = tmp / f"backends-{port}.txt"
    log = tmp / f"router-{port}.log"
    router = Router(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kubeinfer",
                "router",
                "--backends-file",
                str(backends),
                "--port",
                str(port),
                "--discovery-interval-s",
                "0.1",
                "--scrape-interval-s",
                "0.2",
                "--log-level",
                "warning",
                *args,
            ],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        ),
        f"http://127.0.0.1:{port}",
        log,
        backends,
    )
    router.set_backends(*urls)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if router.proc.poll() is not None:
            raise RuntimeError(f"router exited {router.proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{router.url}/ready", timeout=2).status_code == 200:
                router.wait_pods(len(urls))
                return router
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    router.proc.kill()
    raise RuntimeError(f"router not ready in {timeout}s: {log.read_text()[-3000:]}")


def stop_router(router: Router) -> None:
    router.proc.terminate()
    try:
        router.proc.wait(15)
    except subprocess.TimeoutExpired:
        router.proc.kill()
        router.proc.wait(5)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The runtime tests' tiny chat model with a 4096-token context, so a stream can run for
    seconds."""
    import json

    out = make_tiny_chat_model(tmp_path_factory.mktemp("router-model"), smollm2_dir)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (out / "config.json").write_text(json.dumps(config))
    return out


SERVER_ARGS = ("--num-kv-blocks", "1024", "--max-num-seqs", "16")


@pytest.fixture(scope="module")
def two_servers(
    chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Server]]:
    logs = tmp_path_factory.mktemp("router-servers")
    servers = [start_server(chat_model_dir, logs / f"s{i}.log", *SERVER_ARGS) for i in range(2)]
    yield servers
    for server in servers:
        stop_server(server)


@pytest.fixture
def router_factory(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    routers: list[Router] = []

    def make(*urls: str, args: tuple[str, ...] = ()) -> Router:
        routers.append(start_router(tmp_path, *urls, args=args))
        return routers[-1]

    yield make
    for router in routers:
        stop_router(router)
