"""Offline throughput: our engine vs transformers `generate`, SmolLM2-135M float32 on CPU.

64 requests (fixed seed): prompt lengths 16-512, output lengths 16-256, EOS ignored so every
request makes exactly its output length. Baselines in the same run: transformers `generate`
(a) one request at a time, on a fixed subset of 16 of the requests, and (b) in left-padded
batches of 16 over all 64. Output tokens/s for each, and the ratios (goals: >= 3x (b),
>= 10x (a)). Appends a row to bench/RESULTS.md.

    python bench/throughput.py [--model .cache/models/smollm2-135m] [--requests 64]
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


def make_requests(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(16, 512))], rng.randint(16, 256))
        for _ in range(n)
    ]


def ours(model_dir: Path, requests: list[tuple[list[int], int]]) -> tuple[float, int]:
    from kubeinfer.runtime import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32")
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    llm.generate([p for p, _ in requests[:2]], params[:2])  # warm-up
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def hf_model(model_dir: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_one_at_a_time(model, requests: list[tuple[list[int], int]]) -> tuple[float, int]:  # noqa: ANN001
    start = time.perf_counter()
    for prompt, m in requests:
        model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=m,
            min_new_tokens=m,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - start, sum(m for _, m in requests)


@torch.inference_mode()
def hf_padded_batches(
    model, requests: list[tuple[list[int], int]], batch: int = 16
) -> tuple[float, int]:  # noqa: ANN001
    start = time.perf_counter()
    for b in range(0, len(requests), batch):
        group = requests[b : b + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for i, (p, _) in enumerate(group):  # left padding, as decoder-only generate needs
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        m = max(n for _, n in group)
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=m,
            min_new_tokens=m,
            do_sample=False,
            pad_token_id=0,
        )
    # only the tokens each request asked for count; the padding rows' extra tokens are waste
    return time.perf_counter() - start, sum(m for _, m in requests)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=Path(".cache/models/smollm2-135m"))
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    requests = make_requests(args.requests, vocab=49152)
    rows = {"kubeinfer (all)": ours(args.model, requests)}
    model = hf_model(args.model)
    rows["transformers padded x16 (all)"] = hf_padded_batches(model, requests)
    rows["transformers one at a time (16)"] = hf_one_at_a_time(model, requests[:16])
    print(f"{'':34} {'seconds':>8} {'out tokens':>10} {'out tok/s':>10}")
    rate = {}
    for name, (seconds, tokens) in rows.items():
        rate[name] = tokens / seconds
        print(f"{name:34} {seconds:8.1f} {tokens:10d} {rate[name]:10.1f}")
    ours_rate = rate["kubeinfer (all)"]
    vs_b = ours_rate / rate["transformers padded x16 (all)"]
    vs_a = ours_rate / rate["transformers one at a time (16)"]
    print(
        f"ratio_vs_padded_batches={vs_b:.2f} (goal >= 3) ratio_vs_one_at_a_time={vs_a:.2f} "
        f"(goal >= 10)"
    )
    with RESULTS.open("a") as f:
        f.write(
            f"| {dt.date.today()} | throughput | SmolLM2-135M fp32 CPU, {args.requests} req | "
            f"{ours_rate:.1f} out tok/s | HF padded x16 "
            f"{rate['transformers padded x16 (all)']:.1f}, HF one-by-one "
            f"{rate['transformers one at a time (16)']:.1f} out tok/s | "
            f"{vs_b:.2f}x (b), {vs_a:.2f}x (a) |\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
