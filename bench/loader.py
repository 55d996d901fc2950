"""Loader benchmark: peak host memory and time of our streamed loader vs a naive full load.

Each way runs in a fresh subprocess on the same random sharded checkpoint (~300 MB float32).
Baseline in the same run: `safetensors.torch.load_file` of every shard, then
`load_state_dict` into an initialized model (what a loader that is not streamed does).
Prints both rows and the ratios, and appends a row to bench/RESULTS.md.

    python bench/loader.py [--dir DIR] [--hidden 1024 --layers 3 --vocab 16000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(mode: str, model_dir: str) -> None:
    """Measure one load in this process; print a JSON line."""
    import torch

    from kubeinfer.runtime.loader import load_model
    from kubeinfer.runtime.models import ModelConfig, build_model

    config = ModelConfig.from_dir(model_dir)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    baseline = _status_kib("VmRSS")
    start = time.perf_counter()
    if mode == "ours":
        model = load_model(model_dir, dtype="float32", device="cpu")
    elif mode.startswith("ours-tp"):  # rank 1 of N's shard (`ours-tp2`); loading needs no group
        from kubeinfer.runtime.models.parallel import TPGroup

        tp = TPGroup(1, int(mode.removeprefix("ours-tp")))
        model = load_model(model_dir, dtype="float32", device="cpu", tp=tp)
    else:
        from safetensors.torch import load_file

        model = build_model(config).float()
        state: dict[str, torch.Tensor] = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            state.update(load_file(f))
        fused: dict[str, torch.Tensor] = {}
        for name in list(state):
            target = model.checkpoint_target(name)
            if target is None:
                continue
            fused.setdefault(target.param_name, []).append(state.pop(name))  # type: ignore[arg-type]
        model.load_state_dict({k: torch.cat(v) for k, v in fused.items()}, strict=False)
        model.materialize(torch.device("cpu"))
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    params = {p.data_ptr(): p for p in model.parameters()}.values()
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    print(
        json.dumps(
            {
                "mode": mode,
                "seconds": seconds,
                "baseline_bytes": baseline * 1024,
                "peak_bytes": peak * 1024,
                "model_bytes": model_bytes,
                "largest_param_bytes": largest,
            }
        )
    )


def measure(mode: str, model_dir: Path) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(model_dir)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_checkpoint(model_dir: Path, hidden: int, layers: int, vocab: int) -> None:
    from kubeinfer.runtime.testing import llama_config, write_random_checkpoint

    config = llama_config(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
        vocab_size=vocab,
    )
    write_random_checkpoint(model_dir, config, num_shards=3)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=2, metavar=("MODE", "DIR"))
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=16000)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.dir or Path(tmp) / "ckpt"
        if not (model_dir / "config.json").exists():
            make_checkpoint(model_dir, args.hidden, args.layers, args.vocab)
        rows = {mode: measure(mode, model_dir) for mode in ("naive", "ours")}
    mib = 1 << 20
    print(f"{'loader':8} {'time s':>8} {'peak RSS - baseline MiB':>24} {'over model MiB':>15}")
    extra = {mode: r["peak_bytes"] - r["baseline_bytes"] for mode, r in rows.items()}
    for mode, r in rows.items():
        over = (extra[mode] - r["model_bytes"]) / mib
        print(f"{mode:8} {r['seconds']:8.2f} {extra[mode] / mib:24.0f} {over:15.0f}")
    ours, naive = rows["ours"], rows["naive"]
    mem_ratio = extra["ours"] / extra["naive"]
    time_ratio = ours["seconds"] / naive["seconds"]
    print(
        f"model {ours['model_bytes'] / mib:.0f} MiB, largest tensor "
        f"{ours['largest_param_bytes'] / mib:.0f} MiB"
    )
    print(f"peak_memory_ratio={mem_ratio:.2f} time_ratio={time_ratio:.2f} (ours / naive)")
    with RESULTS.open("a") as f:
        f.write(
            f"| {dt.date.today()} | loader | model {ours['model_bytes'] / mib:.0f} MiB | "
            f"ours {ours['seconds']:.2f} s, +{extra['ours'] / mib:.0f} MiB peak | "
            f"naive {naive['seconds']:.2f} s, +{extra['naive'] / mib:.0f} MiB peak | "
            f"memory ratio {mem_ratio:.2f}, time ratio {time_ratio:.2f} |\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
