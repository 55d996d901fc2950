"""Servers under test: `kubeinfer serve` subprocesses on 127.0.0.1 (free ports, bounded waits)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path
    model_name: str
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:  # noqa: ANN003
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics, name{labels} -> value (parsed with prometheus_client)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name"
                )
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out


def start_server(
    model_dir: Path, log: Path, *args: str, api_key: str | None = None, timeout: float = 180
) -> Server:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if api_key:
        env["KUBEINFER_API_KEY"] = api_key
    cmd = [
        sys.executable,
        "-m",
        "kubeinfer",
        "serve",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *args,
    ]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log, model_dir.name, api_key)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{server.url}/ready", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"server not ready in {timeout}s: {log.read_text()[-3000:]}")


def stop_server(server: Server) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)
    return server.proc.returncode


def make_tiny_chat_model(root: Path, smollm2_dir: Path) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer and chat template: text in, fast."""
    import torch
    import transformers

    out = root / "tiny-chat"
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), smollm2_dir)


@pytest.fixture(scope="session")
def long_chat_dir(tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model with an 8192-token context: one request can hold a sequence busy
    for seconds."""
    import json

    out = tmp_path_factory.mktemp("long-chat") / "tiny-chat"
    shutil.copytree(tiny_chat_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def smol_server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "smollm2.log"
    server = start_server(smollm2_dir, log, "--num-kv-blocks", "512", "--dtype", "float32")
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def tiny_server(tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Small limits on purpose: max_model_len 128, 4 KiB bodies, an API key."""
    log = tmp_path_factory.mktemp("logs") / "tiny.log"
    server = start_server(
        tiny_chat_dir,
        log,
        "--max-model-len",
        "128",
        "--num-kv-blocks",
        "600",
        "--max-request-bytes",
        "4096",
        "--max-num-seqs",
        "64",
        api_key=API_KEY,
    )
    yield server
    stop_server(server)
