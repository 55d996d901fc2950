"""Scheduler benchmark with a null model: per-step host time and KV memory waste.

256 requests decode at steady state (each finishing one is replaced by a new one). Per step we
time `Scheduler.schedule()` plus `build_step_batch()` (what the runner does before the model
runs); the model is a null one that returns token 7. KV waste is (allocated - used) / used over
the paged pool, beside the baseline in the same run: a contiguous per-request cache reserved at
max length (max_model_len) as a non-paged server would. Goals: <= 1 ms per step, <= 4 % waste.

    python bench/scheduler.py [--requests 256 --steps 400 --max-model-len 2048]
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import sys
import time
from pathlib import Path

from kubeinfer.runtime.engine.batch import BlockTableArray, build_step_batch
from kubeinfer.runtime.engine.kv_cache import KVCacheManager
from kubeinfer.runtime.engine.request import Request
from kubeinfer.runtime.engine.sampling_params import SamplingParams
from kubeinfer.runtime.engine.scheduler import Scheduler

RESULTS = Path(__file__).with_name("RESULTS.md")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=100_000, block_size=args.block_size)
    sched = Scheduler(
        kv,
        max_num_seqs=args.requests,
        max_num_batched_tokens=1 << 20,
        max_model_len=args.max_model_len,
    )
    tables = BlockTableArray(args.requests, -(-args.max_model_len // args.block_size))
    counter = iter(range(10**9))

    def new_request() -> Request:
        n = rng.randint(64, 1024)
        out = rng.randint(16, 512)
        rid = f"r{next(counter)}"
        return Request(
            rid, [rng.randrange(1, 50000) for _ in range(n)], SamplingParams(max_tokens=out)
        )

    for _ in range(args.requests):
        sched.add(new_request())
    times, waste, baseline_waste = [], [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        build_step_batch(out, kv.block_ids, args.block_size, tables)
        times.append(time.perf_counter() - t0)
        for s in out.scheduled:  # the null model and the engine's bookkeeping
            r = s.request
            r.num_computed_tokens += s.num_new_tokens
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(7)
                if r.num_output_tokens >= r.sampling_params.max_tokens:
                    sched.finish(r, "length")
                    tables.release(r.request_id)
                    sched.add(new_request())
        if step >= 20:  # steady state: past the first prefill wave
            used = sum(r.num_computed_tokens for r in sched.running)
            allocated = (
                sum(len(kv.block_ids(r.request_id)) for r in sched.running) * args.block_size
            )
            waste.append((allocated - used) / used)
            baseline_waste.append((len(sched.running) * args.max_model_len - used) / used)
    decode_times = times[20:]
    p50 = statistics.median(decode_times) * 1e3
    p99 = sorted(decode_times)[int(0.99 * len(decode_times))] * 1e3
    ours, base = statistics.mean(waste) * 100, statistics.mean(baseline_waste) * 100
    print(f"{args.requests} running requests, {args.steps} steps")
    print(f"schedule + batch prep per step: p50 {p50:.3f} ms, p99 {p99:.3f} ms (goal <= 1 ms)")
    print(
        f"KV waste: paged {ours:.2f} %  vs contiguous max-length {base:.0f} % "
        f"(ratio {ours / base:.4f}; goal <= 4 %)"
    )
    with RESULTS.open("a") as f:
        f.write(
            f"| {dt.date.today()} | scheduler | {args.requests} running, null model | "
            f"p50 {p50:.3f} ms/step, waste {ours:.2f} % | contiguous waste {base:.0f} % | "
            f"waste ratio {ours / base:.4f} |\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
