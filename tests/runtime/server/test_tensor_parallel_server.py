"""`kubeinfer serve --tensor-parallel-size 2` on CPU: it serves, and a rank killed mid-run
fails /health within seconds (the pod's liveness probe then restarts it), never a silent hang.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.runtime.server.conftest import Server, start_server, stop_server


def _worker_pids(parent: int) -> list[int]:
    """The tensor-parallel worker processes of `parent` (spawned children running
    multiprocessing's spawn_main; the resource tracker is not one)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.fixture
def tp_server(long_chat_dir: Path, tmp_path: Path) -> Server:
    server = start_server(
        long_chat_dir,
        tmp_path / "tp.log",
        "--tensor-parallel-size",
        "2",
        "--num-kv-blocks",
        "1024",
        "--dtype",
        "float32",
    )
    yield server  # type: ignore[misc]
    stop_server(server)


def test_tp_server_serves_and_a_killed_rank_fails_health_within_seconds(tp_server: Server) -> None:
    body = {"model": tp_server.model_name, "prompt": "Hello there", "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    with tp_server.client() as client:
        first = client.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["completion_tokens"] == 8
        assert client.get("/health").status_code == 200

    (worker,) = _worker_pids(tp_server.proc.pid)
    streamed: list[str] = []
    done = threading.Event()

    def stream() -> None:  # a long generation: the kill lands mid-run
        long = {**body, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{tp_server.url}/v1/completions", json=long,
                              timeout=60) as r:  # fmt: skip
                for line in r.iter_lines():
                    streamed.append(line)
        except httpx.HTTPError as e:
            streamed.append(f"error {e}")
        finally:
            done.set()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while sum(line.startswith("data: {") for line in streamed) < 5:
        assert time.monotonic() < deadline, "no tokens streamed"
        time.sleep(0.05)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    while True:
        status = httpx.get(f"{tp_server.url}/health", timeout=5)
        if status.status_code == 503:
            break
        assert time.monotonic() - killed < 5, "health still ok 5 s after a rank was killed"
        time.sleep(0.05)
    took = time.monotonic() - killed
    assert "tensor-parallel rank 1" in status.json()["error"], status.text
    assert done.wait(10), "the stream did not end after the rank died"
    assert any("error" in line for line in streamed[-6:]), streamed[-6:]
    assert httpx.get(f"{tp_server.url}/ready", timeout=5).status_code == 503
    print(f"health failed {took:.2f} s after the kill")
