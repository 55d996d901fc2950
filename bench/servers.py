"""`kubeinfer serve` for the benchmarks: a subprocess on 127.0.0.1, ready or a clear exit."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_server(model: Path, port: int, *args: str, timeout: float = 300) -> subprocess.Popen:
    """Start `kubeinfer serve --model MODEL --port PORT ARGS...` and wait for /ready."""
    cmd = [sys.executable, "-m", "kubeinfer", "serve", "--model", str(model), "--port", str(port)]
    server = subprocess.Popen([*cmd, "--log-level", "warning", *args])
    return wait_ready(server, f"http://127.0.0.1:{port}/ready", "kubeinfer serve", timeout)


def wait_ready(
    server: subprocess.Popen, url: str, what: str, timeout: float = 300
) -> subprocess.Popen:
    """Poll `url` until it answers 200; a clear exit if the server dies or takes too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"{what} exited with {server.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise SystemExit(f"{what} did not become ready in {timeout:.0f} s")
