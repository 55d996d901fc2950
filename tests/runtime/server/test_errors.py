"""Every bad request gets its status code and an OpenAI error body; never a 500 or a traceback."""

from __future__ import annotations

import httpx
import pytest

from .conftest import API_KEY, Server

CHAT = [{"role": "user", "content": "hi"}]
OK = {"prompt": "hello", "max_tokens": 2}

CASES = [
    # (name, method, path, json body or raw bytes, headers, status, words in the message)
    ("malformed json", "POST", "/v1/completions", b'{"prompt": "x",', {}, 400, "JSON"),
    ("not an object", "POST", "/v1/completions", b"[1, 2]", {}, 400, ""),
    ("wrong type", "POST", "/v1/completions", {**OK, "temperature": "hot"}, {}, 400, "temperature"),
    ("out of range", "POST", "/v1/completions", {**OK, "top_p": 1.5}, {}, 400, "top_p"),
    (
        "negative max_tokens",
        "POST",
        "/v1/completions",
        {**OK, "max_tokens": -3},
        {},
        400,
        "max_tokens",
    ),
    ("missing prompt", "POST", "/v1/completions", {"max_tokens": 3}, {}, 400, "prompt"),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, {}, 400, "prompt"),
    (
        "token id out of vocab",
        "POST",
        "/v1/completions",
        {"prompt": [1, 10**7]},
        {},
        400,
        "out of range",
    ),
    (
        "over max_model_len",
        "POST",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 500},
        {},
        400,
        "maximum context length is 128",
    ),
    ("n over the schema's bound", "POST", "/v1/completions", {**OK, "n": 129}, {}, 400, "n:"),
    ("suffix", "POST", "/v1/completions", {**OK, "suffix": "x"}, {}, 400, "suffix"),
    ("best_of > n", "POST", "/v1/completions", {**OK, "best_of": 2}, {}, 400, "best_of"),
    (
        "penalty out of range",
        "POST",
        "/v1/completions",
        {**OK, "presence_penalty": 2.5},
        {},
        400,
        "presence_penalty",
    ),
    ("unknown field", "POST", "/v1/completions", {**OK, "max_tokenz": 3}, {}, 400, "max_tokenz"),
    (
        "stream_options without stream",
        "POST",
        "/v1/completions",
        {**OK, "stream_options": {"include_usage": True}},
        {},
        400,
        "stream_options",
    ),
    ("unknown model", "POST", "/v1/completions", {**OK, "model": "gpt-9"}, {}, 404, "gpt-9"),
    (
        "unknown model (chat)",
        "POST",
        "/v1/chat/completions",
        {"model": "x", "messages": CHAT},
        {},
        404,
        "does not exist",
    ),
    ("empty messages", "POST", "/v1/chat/completions", {"messages": []}, {}, 400, "messages"),
    (
        "bad role",
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        {},
        400,
        "role",
    ),
    (
        "tools",
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [{"type": "function"}]},
        {},
        400,
        "tools",
    ),
    (
        "both max tokens",
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 2, "max_completion_tokens": 3},
        {},
        400,
        "not both",
    ),
    ("body too large", "POST", "/v1/completions", {"prompt": "x" * 8000}, {}, 413, "4096"),
    ("missing api key", "POST", "/v1/completions", OK, {"Authorization": ""}, 401, "API key"),
    (
        "wrong api key",
        "POST",
        "/v1/completions",
        OK,
        {"Authorization": "Bearer nope"},
        401,
        "API key",
    ),
    ("models need the key", "GET", "/v1/models", None, {"Authorization": ""}, 401, "API key"),
    # the tokenizer routes sit behind the same guard as /v1
    ("tokenize needs the key", "POST", "/tokenize", {"prompt": "hi"}, {"Authorization": ""}, 401,
     "API key"),
    ("detokenize body too large", "POST", "/detokenize", {"tokens": [1] * 3000}, {}, 413, "4096"),
    ("detokenize past max_model_len", "POST", "/detokenize", {"tokens": [1] * 129}, {}, 400,
     "at most 128"),
    ("unknown model id", "GET", "/v1/models/nope", None, {}, 404, "nope"),
    ("wrong method", "GET", "/v1/completions", None, {}, 405, ""),
    ("unknown path", "GET", "/v1/nothing-here", None, {}, 404, ""),
]


@pytest.mark.parametrize(
    ("name", "method", "path", "body", "headers", "status", "words"),
    CASES,
    ids=[c[0] for c in CASES],
)
def test_error_case(
    tiny_server: Server,
    name: str,
    method: str,
    path: str,
    body: object,
    headers: dict,
    status: int,
    words: str,
) -> None:
    all_headers = {"Authorization": f"Bearer {API_KEY}", **headers}
    if not all_headers["Authorization"]:
        del all_headers["Authorization"]
    kwargs: dict = {"headers": all_headers}
    if isinstance(body, bytes):
        kwargs["content"] = body
        all_headers["Content-Type"] = "application/json"
    elif body is not None:
        kwargs["json"] = body
    r = httpx.request(method, tiny_server.url + path, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"]
    assert "Traceback" not in r.text


def test_health_and_ready_need_no_key(tiny_server: Server) -> None:
    assert httpx.get(f"{tiny_server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{tiny_server.url}/ready").status_code == 200
    assert "vllm:num_requests_running" in httpx.get(f"{tiny_server.url}/metrics").text
    assert httpx.get(f"{tiny_server.url}/version").json()["version"]


def test_a_good_request_still_works_after_all_that(tiny_server: Server) -> None:
    with tiny_server.client() as c:
        r = c.post("/v1/completions", json={**OK, "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_model_load_failure_is_reported_not_crashed(tmp_path) -> None:  # noqa: ANN001
    import subprocess
    import sys
    import time

    from kubeinfer.runtime.testing import write_random_checkpoint

    from .conftest import free_port

    model = write_random_checkpoint(tmp_path / "broken")
    (model / "model.safetensors").write_bytes(b"garbage")
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kubeinfer",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--log-level",
            "error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        body = None
        for _ in range(120):
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)
                if r.json().get("status") == "failed":
                    body = r.json()
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        assert body is not None and "model.safetensors" in body["error"]
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=OK)
        assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(30)
