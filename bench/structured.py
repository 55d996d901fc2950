"""Structured outputs benchmark: the step-time cost of guided decoding in the batched engine.

At batch 1, 16 and 64 (SmolLM2-135M, fp32, CPU), decode steps are timed with half of the
requests constrained (JSON schemas: a record with enums, bounds and an array, and a long
string; at batch 1 the one request) against the same requests unconstrained, in the same run,
alternating the two (after an untimed warm-up of each), `--repeats` times each; the median of
each is compared. Only steps where
all the batch decodes are timed (no prefill, nobody finished). The guided work itself
(matchers fed, bitmask filled and applied) is timed too, as ms per step, and its share of the
unconstrained step: on a busy machine the step times drift by more than the guided work, and
the share is the steadier figure. Goal: under 10 % slower. Appends a row to bench/RESULTS.md.

    python bench/structured.py [--batches 1 16 64 --steps 16 --repeats 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

from kubeinfer.runtime import LLM, SamplingParams
from kubeinfer.runtime.engine.guided import GrammarMatchers
from kubeinfer.runtime.engine.guided_spec import GuidedSpec

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).with_name("RESULTS.md")
MODEL = REPO / ".cache" / "models" / "smollm2-135m"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}},
        "bio": {"type": "string", "minLength": 400},
    },
    "required": ["name", "age", "color", "hobbies", "bio"],
    "additionalProperties": False,
}
STORY = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 400}},
    "required": ["story"],
}
SPECS = [GuidedSpec("json", json.dumps(PERSON)), GuidedSpec("json", json.dumps(STORY))]


class GuidedTimer:
    """Wraps the matchers' per-step work to add up its time."""

    def __init__(self, matchers: GrammarMatchers) -> None:
        self.seconds = 0.0
        for name in ("sync", "mask_logits"):
            original = getattr(matchers, name)

            def timed(*args: object, _f=original) -> None:  # noqa: ANN001
                t0 = time.perf_counter()
                _f(*args)
                self.seconds += time.perf_counter() - t0

            setattr(matchers, name, timed)


def step_times(llm: LLM, batch: int, guided: bool, steps: int, timer: GuidedTimer) -> tuple:
    """Mean seconds per all-decode step, and guided seconds per step, over `steps` steps."""
    engine = llm.engine
    tok = llm.tokenizer
    ids = []
    for i in range(batch):
        prompt = f"Request {i}: describe a person in JSON, with a long biography."
        p = tok.encode_chat([{"role": "user", "content": prompt}])
        spec = SPECS[i % 2] if guided and (i % 2 == 0) else None
        params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True, guided=spec)
        ids.append(engine.add_request(p, params))
    while any(r.num_output_tokens == 0 for r in engine._requests.values()):
        engine.step()  # prefill
    engine.step()  # the first decode (grammar matchers built)
    timed, t_guided = [], 0.0
    for _ in range(steps):
        timer.seconds = 0.0
        t0 = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - t0
        if len(outs) != batch or any(o.finished for o in outs):
            break
        timed.append(elapsed)
        t_guided += timer.seconds
    for request_id in ids:
        engine.abort(request_id)
    return statistics.mean(timed), t_guided / max(len(timed), 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model, dtype="float32", num_kv_blocks=1024, max_num_seqs=max(args.batches))
    timer = GuidedTimer(llm.engine.runner.grammar_matchers)
    for spec in SPECS:
        llm.engine.grammars.compile(spec)  # compile (and cache) before timing
    cells = []
    for batch in args.batches:
        free, guided, host = [], [], []
        step_times(llm, batch, False, 2, timer)  # warm-up: first-use allocations, kernels
        step_times(llm, batch, True, 2, timer)
        for repeat in range(args.repeats):
            for is_guided in (False, True) if repeat % 2 == 0 else (True, False):
                t, h = step_times(llm, batch, is_guided, args.steps, timer)
                if is_guided:
                    guided.append(t)
                    host.append(h)
                else:
                    free.append(t)
        f, g, h = statistics.median(free), statistics.median(guided), statistics.median(host)
        ratio = g / f
        print(
            f"batch {batch:3d}: unconstrained {f * 1e3:7.1f} ms/step, half constrained "
            f"{g * 1e3:7.1f} ms/step (guided work {h * 1e3:.2f} ms/step), ratio {ratio:.3f}"
        )
        cells.append((batch, f, g, h, ratio))
    ours = ", ".join(f"b{b} {g * 1e3:.1f} ms (guided {h * 1e3:.2f})" for b, _, g, h, _ in cells)
    base = ", ".join(f"b{b} {f * 1e3:.1f} ms" for b, f, _, _, _ in cells)
    ratios = ", ".join(f"b{b} {r:.3f}" for b, _, _, _, r in cells)
    shares = ", ".join(f"b{b} {h / f * 100:.1f} %" for b, f, _, h, _ in cells)
    met = "met" if all(r < 1.10 for *_, r in cells) else "missed"
    load = os.getloadavg()[1]  # a busy machine's step times drift more than the guided work
    print(f"guided work as a share of the unconstrained step: {shares}")
    with RESULTS.open("a") as out:
        out.write(
            f"| {dt.date.today()} | structured | SmolLM2-135M fp32 CPU, decode step, half of the "
            f"batch JSON-schema constrained (xgrammar), load {load:.1f} | {ours} | "
            f"unconstrained {base} | "
            f"step ratio {ratios} (goal < 1.10: {met}); guided work {shares} of a step |\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
