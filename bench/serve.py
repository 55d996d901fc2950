"""Served vs offline throughput: `kubeinfer serve` under a bounded open-loop load, beside the
same requests through the offline `LLM.generate` in the same run.

The load is `kubeinfer.runtime.loadgen.run_load` (Poisson arrivals at `--rate`, fixed seed, at
most `--concurrency` in flight; prompt and output lengths drawn from the given ranges, EOS
ignored). Prints throughput, TTFT and inter-token latency p50/p99, and the served / offline
output-token throughput ratio (goal >= 0.9). Appends a row to bench/RESULTS.md.

    python bench/serve.py [--model .cache/models/smollm2-135m] [--requests 64] [--rate 20]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import random
import sys
import time
from pathlib import Path

from servers import start_server

from kubeinfer.runtime.loadgen import run_load

RESULTS = Path(__file__).with_name("RESULTS.md")
TOKEN_IDS = (100, 5000)


def same_requests(n: int, seed: int, prompt_len: tuple[int, int], output_len: tuple[int, int]):  # noqa: ANN201
    """The prompts and output lengths run_load draws for this seed (its draw order)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        n_out = rng.randint(*output_len)
        prompt = [rng.randrange(*TOKEN_IDS) for _ in range(rng.randint(*prompt_len))]
        out.append((prompt, n_out))
    return out


def offline(model: Path, requests, args) -> tuple[float, int]:  # noqa: ANN001
    from kubeinfer.runtime import LLM, SamplingParams

    llm = LLM(model, dtype="float32", num_kv_blocks=args.num_kv_blocks)
    params = [
        SamplingParams(temperature=0, max_tokens=m, min_tokens=m, ignore_eos=True)
        for _, m in requests
    ]
    llm.generate([p for p, _ in requests[:2]], params[:2])  # warm-up, as the server's first
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=Path(".cache/models/smollm2-135m"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 96))
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--port", type=int, default=18731)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = start_server(
        args.model,
        args.port,
        "--dtype", "float32",
        "--num-kv-blocks", str(args.num_kv_blocks),
    )  # fmt: skip
    try:
        load = dict(
            num_requests=args.requests,
            rate=args.rate,
            concurrency=args.concurrency,
            seed=args.seed,
            prompt_len=tuple(args.prompt_len),
            output_len=tuple(args.output_len),
            token_id_range=TOKEN_IDS,
        )
        asyncio.run(run_load([url], **{**load, "num_requests": 2, "seed": 99}))  # warm-up
        report = asyncio.run(run_load([url], **load))
    finally:
        server.terminate()
        server.wait(60)
    if report.num_failed:
        raise SystemExit(f"{report.num_failed} requests failed: {report.errors}")
    requests = same_requests(
        args.requests, args.seed, tuple(args.prompt_len), tuple(args.output_len)
    )
    seconds, tokens = offline(args.model, requests, args)
    offline_rate = tokens / seconds
    served_rate = report.output_tokens_per_s
    assert report.output_tokens == tokens, (report.output_tokens, tokens)
    print(report.summary())
    print(f"served  {served_rate:8.1f} output tok/s over {report.duration_s:.1f} s")
    print(f"offline {offline_rate:8.1f} output tok/s over {seconds:.1f} s (same requests)")
    ratio = served_rate / offline_rate
    print(f"served_over_offline={ratio:.2f} (goal >= 0.9)")
    with RESULTS.open("a") as f:
        f.write(
            f"| {dt.date.today()} | serve | SmolLM2 fp32 CPU, {args.requests} req @ "
            f"{args.rate}/s | {served_rate:.1f} out tok/s, TTFT p50 "
            f"{report.ttft_p50_s * 1e3:.0f} ms p99 {report.ttft_p99_s * 1e3:.0f} ms, ITL p50 "
            f"{report.itl_p50_s * 1e3:.0f} ms p99 {report.itl_p99_s * 1e3:.0f} ms | offline "
            f"{offline_rate:.1f} out tok/s | {ratio:.2f} |\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
