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

`--peer`: the same comparison against vLLM's CPU build (the peer of bench/peer_vllm.py,
installed by hack/peer_vllm.sh), end to end: each engine in a process of its own generates
`--peer-tokens` tokens for `--peer-batch` chat requests (the same token ids, greedy, JSON
without free whitespace in both), all unconstrained and then half constrained with the same
schemas, alternating, `--repeats` times after a warm-up that compiles the grammars; prints
each engine's output tokens/s both ways, its guided/unconstrained time ratio, and ours / vLLM.

    python bench/structured.py [--batches 1 16 64 --steps 16 --repeats 3]
    python bench/structured.py --peer [--peer-batch 16 --peer-tokens 64]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:
    from kubeinfer.runtime import LLM, SamplingParams
    from kubeinfer.runtime.engine.guided import GrammarMatchers
    from kubeinfer.runtime.engine.guided_spec import GuidedSpec
except ImportError:  # --peer-worker vllm runs this file in the peer's venv, without kubeinfer
    LLM = SamplingParams = GrammarMatchers = GuidedSpec = None  # type: ignore[assignment,misc]

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
SCHEMAS = [PERSON, STORY]
SPECS = [GuidedSpec("json", json.dumps(s)) for s in SCHEMAS] if GuidedSpec is not None else []


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


# --- --peer: end to end against vLLM's CPU build ------------------------------------------


def peer_worker(engine: str, model: Path, spec_file: Path) -> dict[str, object]:
    """In its own process: {"free": [s...], "guided": [s...], "tokens": {...}} for one engine."""
    job = json.loads(spec_file.read_text())
    prompts, tokens, repeats = job["prompts"], job["tokens"], job["repeats"]
    schemas = job["schemas"]
    if engine == "ours":
        from kubeinfer.runtime.malloc import reexec_with_tcmalloc

        reexec_with_tcmalloc()  # as `kubeinfer serve` runs on CPU
        llm = LLM(model, dtype="float32", max_num_seqs=len(prompts))

        def params(guided: bool) -> list:
            return [
                SamplingParams(
                    temperature=0,
                    max_tokens=tokens,
                    guided=SPECS[i // 2 % 2] if guided and i % 2 == 0 else None,
                )
                for i in range(len(prompts))
            ]

        generate = llm.generate
        inputs: list = prompts
    else:
        from vllm import LLM as VLLM  # the peer's venv
        from vllm import SamplingParams as VParams
        from vllm.sampling_params import StructuredOutputsParams

        vllm = VLLM(model=str(model), dtype="float32", seed=0, max_model_len=2048)

        def params(guided: bool) -> list:
            out = []
            for i in range(len(prompts)):
                so = None
                if guided and i % 2 == 0:
                    so = StructuredOutputsParams(
                        json=schemas[i // 2 % 2], disable_any_whitespace=True
                    )
                out.append(VParams(temperature=0, max_tokens=tokens, structured_outputs=so))
            return out

        def generate(p: list, sp: list) -> list:
            return vllm.generate(p, sp, use_tqdm=False)

        inputs = [{"prompt_token_ids": p} for p in prompts]
    generate(inputs, params(True))  # warm-up: grammars compiled, first-use allocations
    generate(inputs, params(False))
    result: dict[str, list] = {"free": [], "guided": [], "free_tokens": [], "guided_tokens": []}
    for r in range(repeats):
        for guided in (False, True) if r % 2 == 0 else (True, False):
            t0 = time.perf_counter()
            outs = generate(inputs, params(guided))
            key = "guided" if guided else "free"
            result[key].append(time.perf_counter() - t0)
            result[f"{key}_tokens"].append(sum(len(o.outputs[0].token_ids) for o in outs))
    return result


def run_peer_worker(engine: str, model: Path, spec_file: Path) -> dict[str, object]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import peer_vllm

    if engine == "vllm":
        python, env = str(peer_vllm.cache_dir() / "bin" / "python"), peer_vllm.peer_env()
    else:
        python, env = sys.executable, dict(os.environ)
    with tempfile.TemporaryDirectory() as cwd:  # no operator/ folder here (the peer's workers)
        cmd = [python, str(Path(__file__).resolve()), "--peer-worker", engine]
        cmd += ["--model", str(model.resolve()), "--spec-file", str(spec_file)]
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{engine} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def peer_main(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import peer_vllm

    if (why := peer_vllm.setup_peer()) is not None:
        print(f"SKIP: the peer is not available here: {why}")
        return 0
    from kubeinfer.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(args.model)
    prompts = [
        tok.encode_chat(
            [
                {
                    "role": "user",
                    "content": f"Request {i}: describe a person in JSON, with a long biography.",
                }
            ]
        )
        for i in range(args.peer_batch)
    ]
    job = {
        "prompts": prompts,
        "tokens": args.peer_tokens,
        "repeats": args.repeats,
        "schemas": SCHEMAS,
    }
    rates: dict[str, dict[str, float]] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(job, f)
        f.flush()
        for engine in ("vllm", "ours"):
            res = run_peer_worker(engine, args.model, Path(f.name))
            rates[engine] = {
                k: statistics.median(n / s for n, s in zip(res[f"{k}_tokens"], res[k], strict=True))
                for k in ("free", "guided")
            }
    print(
        f"{'engine':6} {'unconstrained tok/s':>20} {'half constrained tok/s':>23} {'slowdown':>9}"
    )
    for e in ("vllm", "ours"):
        r = rates[e]
        print(f"{e:6} {r['free']:20.1f} {r['guided']:23.1f} {r['free'] / r['guided']:6.3f}")
    ours, peer = rates["ours"], rates["vllm"]
    ratio = ours["guided"] / peer["guided"]
    print(f"ours / vLLM, half constrained: {ratio:.2f}")
    load = os.getloadavg()[1]
    with RESULTS.open("a") as out:
        out.write(
            f"| {dt.date.today()} | structured peer | SmolLM2-135M fp32 CPU offline, "
            f"{args.peer_batch} chat requests x {args.peer_tokens} tokens, half JSON-schema "
            f"constrained, load {load:.1f} | {ours['guided']:.1f} tok/s (unconstrained "
            f"{ours['free']:.1f}, slowdown {ours['free'] / ours['guided']:.3f}) | vLLM "
            f"{peer_vllm.PEER_VERSION} CPU {peer['guided']:.1f} tok/s (unconstrained "
            f"{peer['free']:.1f}, slowdown {peer['free'] / peer['guided']:.3f}) | "
            f"{ratio:.2f}x |\n"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer", action="store_true", help="end to end against vLLM's CPU build")
    parser.add_argument("--peer-batch", type=int, default=16)
    parser.add_argument("--peer-tokens", type=int, default=64)
    parser.add_argument("--peer-worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--spec-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_worker:
        res = peer_worker(args.peer_worker, args.model, args.spec_file)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    if args.peer:
        return peer_main(args)
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
