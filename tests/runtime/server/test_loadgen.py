"""`run_load` and `kubeinfer loadgen` against the tiny server: counts agree with /metrics."""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from kubeinfer.cli import app
from kubeinfer.runtime.loadgen import _report, _Result, run_load

from .conftest import API_KEY, Server

pytestmark = pytest.mark.timeout(120)


def test_open_loop_load_is_bounded_and_counted(tiny_server: Server) -> None:
    before = tiny_server.metrics()["vllm:generation_tokens_total"]
    dead = "http://127.0.0.1:9"  # nothing listens: half the requests fail, none hang
    report = asyncio.run(
        run_load(
            [tiny_server.url, dead],
            num_requests=12,
            rate=40.0,
            concurrency=4,
            seed=1,
            prompt_len=(4, 16),
            output_len=(4, 8),
            model=tiny_server.model_name,
            api_key=API_KEY,
            timeout=30,
        )
    )
    assert report.requests_per_url == {tiny_server.url: 6, dead: 6}
    assert report.num_ok == 6 and report.errors == {"ConnectError": 6}
    assert 6 * 4 <= report.output_tokens <= 6 * 8
    after = tiny_server.metrics()["vllm:generation_tokens_total"]
    assert after - before == report.output_tokens
    assert 0 < report.ttft_p50_s <= report.ttft_p99_s
    assert 0 < report.itl_p50_s <= report.itl_p99_s


def test_cli_closed_loop_json(tiny_server: Server) -> None:
    result = CliRunner().invoke(
        app,
        ["loadgen", "--url", tiny_server.url, "--num-requests", "6", "--concurrency", "3"]
        + ["--prompt-len", "4:8", "--output-len", "5", "--api-key", API_KEY, "--json"],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["num_ok"] == 6 and report["output_tokens"] == 30
    assert report["output_tokens_per_s"] > 0


def test_tpot_is_not_fooled_by_bursty_chunks() -> None:
    """A server that sends its chunks in bursts has inter-token gaps near 0 (p50 0 ms, as ours
    had on a loaded machine), but its time per output token is the real pace."""
    bursty = _Result("u", True, ttft_s=0.1, e2e_s=1.1, gaps_s=[0.0, 0.0, 0.0, 0.2] * 5)
    bursty.output_tokens = 21
    steady = _Result("u", True, ttft_s=0.1, e2e_s=0.6, gaps_s=[0.05] * 10)
    steady.output_tokens = 11
    alone = _report([bursty], 1, 2.0)
    assert alone.itl_p50_s == 0.0 and alone.tpot_p50_s == pytest.approx(0.05)
    report = _report([bursty, steady, _Result("u", False, error="x")], 3, 2.0)
    assert report.tpot_p50_s == pytest.approx(0.05) and report.num_failed == 1
