"""Offline throughput benchmark (GPU only): our engine vs transformers on the same prompts.

Models: random bfloat16 weights in the shapes of Llama-3.2-1B and Llama-3.1-8B, drawn on the
GPU and written as an HF checkpoint to a scratch folder (nothing is downloaded); the numbers
measure the serving stack, not the model's answers. Workload: `--num-requests` prompts of
random token ids with a ShareGPT-like length mix (lognormal fits, fixed seed; not the data set),
each generating exactly its drawn output length (greedy, EOS ignored).

Measured in the same run, per shape:
  - ours: `LLM(...).generate(all prompts)`: total (prompt + output) and output tokens/s;
  - baseline: transformers `generate` with a static cache, greedy, on the first
    `--baseline-requests` prompts in batches (left padded; only real tokens counted);
  - decode-step time at batch 1 (one request's time per extra output token) beside its floor,
    the weight bytes a step reads / the bandwidth of a large device-to-device copy.
Goals (issue 8): >= 100,000 total tok/s on the 1B shape, >= 9,000 output tok/s on the 8B shape,
>= 10x transformers. Prints a table last; appends one row per shape to bench/RESULTS.md.

    python bench/gpu_throughput.py [--shapes 1b,8b] [--num-requests 1000] [--baseline-requests 64]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).with_name("RESULTS.md")
LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_ROPE["original_max_position_embeddings"] = 8192
COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
SHAPES = {
    "1b": {
        **COMMON,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0},
    },
    "8b": {
        **COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_scaling": {**LLAMA3_ROPE, "factor": 8.0},
    },
}
GOALS = {"1b": ("total", 100_000.0), "8b": ("output", 9_000.0)}
MAX_MODEL_LEN = 4096
SHARD_BYTES = 2 << 30


def need_gpu() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_throughput: needs a CUDA GPU (torch.cuda.is_available() is False); not run")


def weight_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Llama checkpoint."""
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    shapes["model.norm.weight"] = (h,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], h)
    return shapes


def decode_weight_bytes(c: dict) -> int:
    """Bytes of weights one decode step reads: all but the embedding table, which only a tied
    lm_head reads whole."""
    shapes = weight_shapes(c)
    total = sum(int(np.prod(s)) for s in shapes.values()) * 2
    if not c["tie_word_embeddings"]:
        total -= c["vocab_size"] * c["hidden_size"] * 2
    return total


def write_checkpoint(c: dict, out: Path) -> None:
    """Random bfloat16 weights drawn on the GPU, saved in ~2 GiB shards with an index."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(c, indent=1))
    g = torch.Generator(device="cuda").manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, num_shards = 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, num_shards
        name = f"model-{num_shards:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard, shard_bytes, num_shards = {}, 0, num_shards + 1

    for name, shape in weight_shapes(c).items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
            t = t.mul_(0.02).cpu()
        shard[name] = t
        shard_bytes += t.numel() * 2
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    index = {
        "metadata": {"total_size": sum(int(np.prod(s)) * 2 for s in weight_shapes(c).values())}
    }
    index["weight_map"] = weight_map
    (out / "model.safetensors.index.json").write_text(json.dumps(index))


def workload(num: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length): lognormal lengths, input mean ~200, output ~190."""
    rng = np.random.default_rng(seed)
    inputs = np.clip(rng.lognormal(np.log(120), 1.0, num), 4, 2048).astype(int)
    outputs = np.clip(rng.lognormal(np.log(130), 0.9, num), 4, 1024).astype(int)
    return [
        (rng.integers(1000, vocab - 1000, n).tolist(), int(m))
        for n, m in zip(inputs, outputs, strict=True)
    ]


def copy_bandwidth() -> float:
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * (1 << 30) * 2 / (ms * 1e-3)


@dataclass(slots=True)
class Run:
    seconds: float
    prompt_tokens: int
    output_tokens: int

    @property
    def total_rate(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    @property
    def output_rate(self) -> float:
        return self.output_tokens / self.seconds


def run_ours(model_dir: Path, work: list[tuple[list[int], int]]) -> tuple[Run, float]:
    """All requests through our engine; and the batch-1 decode-step time in seconds."""
    from kubeinfer.runtime import LLM, SamplingParams

    llm = LLM(model_dir, dtype="bfloat16", device="cuda", max_model_len=MAX_MODEL_LEN)

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    llm.generate([p for p, _ in work[:8]], [params(8)] * 8)  # warm-up (kernels compile)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in work], [params(n) for _, n in work])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    run = Run(seconds, sum(len(p) for p, _ in work), made)

    prompt = work[0][0][:32]
    times = []
    for n in (1, 257):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([prompt], params(n))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del llm
    return run, (times[1] - times[0]) / 256


def run_transformers(model_dir: Path, work: list[tuple[list[int], int]], batch: int) -> Run:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda")
    model.eval()

    def generate(chunk: list[tuple[list[int], int]]) -> None:
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, _) in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        new = max(n for _, n in chunk)
        with torch.inference_mode():
            model.generate(
                input_ids=ids.cuda(),
                attention_mask=mask.cuda(),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                cache_implementation="static",
                pad_token_id=0,
            )

    generate([(work[0][0][:16], 4)])  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(work), batch):
        generate(work[i : i + batch])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return Run(seconds, sum(len(p) for p, _ in work), sum(n for _, n in work))


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1b,8b", help="comma list of: " + ",".join(SHAPES))
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--baseline-requests", type=int, default=64)
    parser.add_argument("--baseline-batch", type=int, default=32)
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder for checkpoints")
    parser.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args()
    need_gpu()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        sys.exit(f"gpu_throughput: unknown shapes {unknown}; choose from {sorted(SHAPES)}")
    gpu = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    scratch = Path(tempfile.mkdtemp(prefix="kubeinfer-bench-", dir=args.dir))
    rows: list[tuple[str, Run, Run, float, float]] = []
    try:
        for name in shapes:
            config = SHAPES[name]
            model_dir = scratch / name
            write_checkpoint(config, model_dir)
            work = workload(args.num_requests, config["vocab_size"])
            ours, step = run_ours(model_dir, work)
            free_gpu()
            base = run_transformers(model_dir, work[: args.baseline_requests], args.baseline_batch)
            free_gpu()
            shutil.rmtree(model_dir)
            rows.append((name, ours, base, step, decode_weight_bytes(config) / bandwidth))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    lines = [
        f"{gpu}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.num_requests} requests "
        f"(transformers: first {args.baseline_requests}, batches of {args.baseline_batch})",
        f"{'shape':<6} {'in tok':>8} {'out tok':>8} {'seconds':>8} {'total/s':>9} {'output/s':>9} "
        f"{'HF total/s':>10} {'vs HF':>6} {'step b=1':>9} {'floor':>8} {'goal':>22}",
    ]
    for name, ours, base, step, floor in rows:
        kind, target = GOALS[name]
        got = ours.total_rate if kind == "total" else ours.output_rate
        goal = f"{kind} >= {target:,.0f}: {'met' if got >= target else 'NOT met'}"
        ratio = ours.total_rate / base.total_rate
        lines.append(
            f"{name:<6} {ours.prompt_tokens:>8} {ours.output_tokens:>8} {ours.seconds:>8.1f} "
            f"{ours.total_rate:>9.0f} {ours.output_rate:>9.0f} {base.total_rate:>10.0f} "
            f"{ratio:>5.1f}x {step * 1e3:>7.2f}ms {floor * 1e3:>6.2f}ms {goal:>22}"
            + ("" if ratio >= 10 else "  (< 10x transformers)")
        )
    print("\n".join(lines))
    if not args.no_results:
        date = dt.date.today().isoformat()
        with RESULTS.open("a") as f:
            for name, ours, base, step, floor in rows:
                f.write(
                    f"| {date} | gpu_throughput {name} | {gpu}, random bf16 Llama {name} shape, "
                    f"{args.num_requests} requests | {ours.total_rate:.0f} total tok/s, "
                    f"{ours.output_rate:.0f} output tok/s, decode step b=1 {step * 1e3:.2f} ms "
                    f"(floor {floor * 1e3:.2f} ms) | transformers static cache "
                    f"{base.total_rate:.0f} total tok/s | "
                    f"{ours.total_rate / base.total_rate:.1f}x |\n"
                )


if __name__ == "__main__":
    main()
