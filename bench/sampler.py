"""Sampler benchmark: the per-step cost of penalties and logprobs at batch 1, 16 and 64.

Logits of SmolLM2's width (49152) in float32, half the rows greedy and half random (top-p 0.9,
half of those seeded). Per step, each penalized request records one more token and the runner's
bookkeeping (`TokenCounts.row`) runs before the sampler, as in a real decode step; each
penalized request holds 512 prompt and 256 output tokens. Four setups, each timed as the median
over `--steps` steps after a warm-up, the setups of a batch size taking turns step by step:

- plain: none of the new stages (the baseline, measured in the same run);
- penalties: every row with presence, frequency and repetition penalties and 8 logit_bias ids;
- logprobs: every row with 5 top logprobs;
- both.

And the sampler as it was before issue #18 (its code path without the new stages, kept here) on
the plain setup, so the ratio shows what a batch that uses none of the features pays now.

One torch thread by default: on the shared 2-core development machine, two threads time how
long a parallel region waits for a descheduled thread (a batch-1 step: median 52 ms, minimum
0.3 ms), not the sampler.

    python bench/sampler.py [--steps 50] [--batches 1,16,64] [--threads 1]
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kubeinfer.runtime.engine.penalties import TokenCounts
from kubeinfer.runtime.engine.request import Request
from kubeinfer.runtime.engine.sampler import Sampler, SamplingRow, first_argmax
from kubeinfer.runtime.engine.sampling_params import SamplingParams

RESULTS = Path(__file__).with_name("RESULTS.md")
VOCAB = 49152
CPU = torch.device("cpu")


def before_18(sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """The sampler's __call__ before issue #18 (bans, argmax, filtered random draws)."""
    logits = logits.float()
    tokens = first_argmax(logits)
    random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if random_rows:
        idx = torch.tensor(random_rows)
        probs = sampler._filtered_probs(logits[idx], [rows[i].params for i in random_rows])
        race = torch.empty_like(probs).exponential_(generator=sampler._generator)
        for j, i in enumerate(random_rows):
            if rows[i].generator is not None:
                race[j].exponential_(generator=rows[i].generator)
        tokens[idx] = first_argmax(probs / race)
    return tokens.tolist()


def make_params(i: int, penalties: bool, logprobs: bool) -> SamplingParams:
    greedy = i % 2 == 0
    extra: dict = {}
    if penalties:
        extra = dict(
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.1,
            logit_bias={t: 2.0 for t in range(100 + i, 108 + i)},
        )
    return SamplingParams(
        temperature=0.0 if greedy else 0.8,
        top_p=0.9,
        seed=i if i % 4 == 1 else None,
        logprobs=5 if logprobs else None,
        **extra,
    )


class Setup:
    """One batch of requests with its sampler, token counts and generators; `step()` times the
    runner's row bookkeeping plus the sampler for one decode step (ms)."""

    def __init__(self, batch: int, penalties: bool, logprobs: bool, legacy: bool = False) -> None:
        rng = random.Random(batch)
        self.legacy = legacy
        self.sampler = Sampler(CPU, seed=0)
        self.counts = TokenCounts(VOCAB, CPU)
        self.requests = []
        for i in range(batch):
            params = make_params(i, penalties, logprobs)
            r = Request(f"r{i}", [rng.randrange(VOCAB) for _ in range(512)], params)
            r.output_token_ids = [rng.randrange(VOCAB) for _ in range(256)]
            self.requests.append(r)
        self.generators = {
            r.request_id: torch.Generator().manual_seed(r.sampling_params.seed)
            for r in self.requests
            if r.sampling_params.seed is not None
        }
        self.logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 4

    def step(self) -> float:
        logits = self.logits.clone()
        t0 = time.perf_counter()
        rows = [
            SamplingRow(
                r.sampling_params,
                self.generators.get(r.request_id),
                (),
                self.counts.row(r) if r.sampling_params.has_penalties else -1,
            )
            for r in self.requests
        ]
        if self.legacy:
            tokens = before_18(self.sampler, logits, rows)
        else:
            tokens = self.sampler(logits, rows, self.counts).token_ids
        elapsed = time.perf_counter() - t0
        for r, token in zip(self.requests, tokens, strict=True):
            r.output_token_ids.append(token)
        return elapsed * 1e3


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    kinds: dict[str, Callable[[int], Setup]] = {
        "pre-#18": lambda b: Setup(b, False, False, legacy=True),
        "plain": lambda b: Setup(b, False, False),
        "penalties": lambda b: Setup(b, True, False),
        "logprobs": lambda b: Setup(b, False, True),
        "both": lambda b: Setup(b, True, True),
    }
    ms: dict[str, list[float]] = {name: [] for name in kinds}
    for b in batches:
        # the setups of a batch size take turns step by step, so a busy machine slows all alike
        setups = {name: make(b) for name, make in kinds.items()}
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for step in range(args.steps + 5):
            for name, setup in setups.items():
                elapsed = setup.step()
                if step >= 5:  # warm-up
                    times[name].append(elapsed)
        for name in kinds:
            ms[name].append(statistics.median(times[name]))
    print(f"sampler ms per step (median of {args.steps}), vocab {VOCAB}, "
          f"{torch.get_num_threads()} threads; batches {batches}")
    for name, values in ms.items():
        ratios = " ".join(f"{v / p:.2f}x" for v, p in zip(values, ms["plain"], strict=True))
        print(f"  {name:10s} " + " ".join(f"{v:8.3f}" for v in values) + f"   vs plain {ratios}")

    def fmt(name: str) -> str:
        return "/".join(f"{v:.2f}" for v in ms[name])

    def ratio(name: str, base: str = "plain") -> str:
        return "/".join(f"{v / b:.2f}" for v, b in zip(ms[name], ms[base], strict=True))

    batch_text = "/".join(map(str, batches))
    row = (
        f"| {dt.date.today()} | sampler | vocab {VOCAB} fp32 CPU ({args.threads} thread), batch "
        f"{batch_text}, half greedy, "
        f"512+256 tokens per penalized row | ms/step: penalties {fmt('penalties')}, logprobs "
        f"{fmt('logprobs')}, both {fmt('both')}, plain {fmt('plain')} | pre-#18 sampler "
        f"{fmt('pre-#18')} ms/step | x plain: penalties {ratio('penalties')}, logprobs "
        f"{ratio('logprobs')}, both {ratio('both')}; plain x pre-#18 "
        f"{ratio('plain', 'pre-#18')} |\n"
    )
    print(row, end="")
    if not args.no_results:
        with RESULTS.open("a") as f:
            f.write(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
