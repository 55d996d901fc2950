"""Tensor parallelism benchmark: TP=1 vs TP=N in the same run, correctness and communication.

For each model, the same greedy requests (EOS ignored) run with one rank and with N ranks
(gloo on CPU, NCCL on CUDA); the table gives output tokens/s, whether every request produced
the same tokens, and for the N-rank run the share of the driver's step time spent inside the
collectives (the all-reduces after o_proj/down_proj and the embedding, the logits gather;
waiting for the slower rank included, since that is what a step pays) with the collectives'
count per step. Appends a row per model to bench/RESULTS.md.

On a 2-core CPU machine, TP=2 gives each rank one core, so no speed-up is expected there
(the point of CPU TP is testing the sharding); on a machine with N GPUs it is the real path.

    python bench/tp.py [--tp 2] [--device cpu] [--requests 16] [--prompt-len 96] [--out 24]
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).with_name("RESULTS.md")
SMOLLM2 = REPO / ".cache" / "models" / "smollm2-135m"


class CollectiveTimer:
    """Wraps TPGroup's collectives in this (the driver's) process and sums their time."""

    def __init__(self) -> None:
        from kubeinfer.runtime.models.parallel import TPGroup

        self.seconds = 0.0
        self.calls = 0
        self._originals = {n: getattr(TPGroup, n) for n in ("all_reduce", "gather_last_dim")}
        for name, fn in self._originals.items():
            setattr(TPGroup, name, self._timed(fn))

    def _timed(self, fn):  # noqa: ANN001, ANN202
        def wrapper(group, x):  # noqa: ANN001, ANN202
            if group.size == 1:
                return fn(group, x)
            start = time.perf_counter()
            try:
                return fn(group, x)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        return wrapper

    def close(self) -> None:
        from kubeinfer.runtime.models.parallel import TPGroup

        for name, fn in self._originals.items():
            setattr(TPGroup, name, fn)


def run(
    model_dir: Path, prompts: list[list[int]], tp: int, device: str, out: int
) -> dict[str, object]:
    from kubeinfer.runtime import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    timer = CollectiveTimer()
    try:
        with LLM(
            model_dir, dtype="float32", device=device, tensor_parallel_size=tp, num_kv_blocks=512
        ) as llm:
            llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
            timer.seconds, timer.calls = 0.0, 0
            steps_before = llm.engine.stats.num_steps
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            steps = llm.engine.stats.num_steps - steps_before
    finally:
        timer.close()
    tokens = [o.outputs[0].token_ids for o in outs]
    return {
        "tokens": tokens,
        "tok_s": sum(map(len, tokens)) / seconds,
        "seconds": seconds,
        "steps": steps,
        "comm_share": timer.seconds / seconds,
        "comm_ms_per_step": 1e3 * timer.seconds / max(steps, 1),
        "collectives_per_step": timer.calls / max(steps, 1),
    }


def synthetic_model(root: Path) -> tuple[Path, str]:
    """A random Llama big enough for the linears to dominate: 16 heads, 4 KV heads."""
    from kubeinfer.runtime.testing import llama_config, write_random_checkpoint

    config = llama_config(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
    )
    return write_random_checkpoint(root / "llama-1024", config), "random Llama h1024 L4 16/4 heads"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--out", type=int, default=24)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = [synthetic_model(Path(tmp))]
        if SMOLLM2.exists():  # 9 heads / 3 KV heads: 3 ranks (2 does not divide it)
            models.append((SMOLLM2, "SmolLM2-135M (TP=3)"))
        for model_dir, label in models:
            tp = 3 if model_dir == SMOLLM2 else args.tp
            vocab = 32000 if model_dir != SMOLLM2 else 49152
            prompts = [
                torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
                for _ in range(args.requests)
            ]
            one = run(model_dir, prompts, 1, args.device, args.out)
            many = run(model_dir, prompts, tp, args.device, args.out)
            same = sum(a == b for a, b in zip(one["tokens"], many["tokens"], strict=True))  # type: ignore[arg-type]
            rows.append((label, tp, one, many, same))
    print(f"{'model':36} {'TP':>3} {'tok/s TP=1':>11} {'tok/s TP=N':>11} {'ratio':>6} "
          f"{'same':>6} {'comm %':>7} {'comm ms/step':>13} {'coll/step':>9}")  # fmt: skip
    for label, tp, one, many, same in rows:
        ratio = many["tok_s"] / one["tok_s"]  # type: ignore[operator]
        print(
            f"{label:36} {tp:>3} {one['tok_s']:>11.1f} {many['tok_s']:>11.1f} {ratio:>6.2f} "
            f"{same:>3}/{args.requests:<2} {100 * many['comm_share']:>6.1f}% "  # type: ignore[operator]
            f"{many['comm_ms_per_step']:>13.2f} {many['collectives_per_step']:>9.1f}"
        )
        with RESULTS.open("a") as f:
            f.write(
                f"| {dt.date.today()} | tp | {label}, {args.device} ({torch.get_num_threads()} "
                f"threads), {args.requests} req x {args.prompt_len} in / {args.out} out | "
                f"TP={tp} {many['tok_s']:.1f} out tok/s, same tokens {same}/{args.requests}, "
                f"collectives {100 * many['comm_share']:.1f} % of step time "  # type: ignore[operator]
                f"({many['comm_ms_per_step']:.2f} ms/step, {many['collectives_per_step']:.0f} "
                f"per step) | TP=1 {one['tok_s']:.1f} out tok/s | {ratio:.2f}x |\n"
            )
    return 0 if all(same == args.requests for *_, same in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
