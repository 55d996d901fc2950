"""Kernel benchmark (GPU only): each Triton kernel beside its torch reference and the HBM floor.

Baselines in the same run: the kernel's `<name>_reference` in torch on the same tensors, and the
bytes the kernel must move at least, divided by the bandwidth of a large device-to-device copy
measured first (read + write). Times are `triton.testing.do_bench` medians. Each kernel is first
checked against its reference (a wrong fast kernel is no result). Goal (issue 8): paged decode
attention at >= 70 % of the copy bandwidth. Prints a table last and appends one row per kernel
to bench/RESULTS.md.

    python bench/gpu_kernels.py [--dtype bfloat16] [--no-results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")
DECODE_GOAL = 0.70


def need_gpu() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_kernels: needs a CUDA GPU (torch.cuda.is_available() is False); not run")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("gpu_kernels: unset TRITON_INTERPRET (it would time triton's interpreter)")


@dataclass(slots=True)
class Row:
    kernel: str
    shape: str
    ms: float
    ref_ms: float
    floor_bytes: int
    error: float

    def bandwidth_fraction(self, bandwidth: float) -> float:
        return self.floor_bytes / (self.ms * 1e-3) / bandwidth


def bench(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting the read and the write."""
    src = torch.empty(1 << 30, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bench_elementwise(
    dtype: torch.dtype, device: torch.device, T: int = 8192, hidden: int = 4096, inter: int = 14336
) -> list[Row]:
    """Defaults: a prefill step of Llama-3.1-8B."""
    from kubeinfer import kernels as K

    rows = []
    x = torch.randn(T, hidden, dtype=dtype, device=device)
    res = torch.randn_like(x)
    w = torch.rand(hidden, dtype=dtype, device=device) + 0.5
    out, new_res = K.rms_norm(x, w, 1e-5, res)
    ref, _ = K.rms_norm_reference(x, w, 1e-5, res)
    rows.append(
        Row(
            "rms_norm+residual",
            f"({T}, {hidden})",
            bench(lambda: K.rms_norm(x, w, 1e-5, res)),
            bench(lambda: K.rms_norm_reference(x, w, 1e-5, res)),
            nbytes(x, res, w, out, new_res),
            rel_err(out, ref),
        )
    )
    gate_up = torch.randn(T, 2 * inter, dtype=dtype, device=device)
    out = K.silu_and_mul(gate_up)
    rows.append(
        Row(
            "silu_and_mul",
            f"({T}, 2x{inter})",
            bench(lambda: K.silu_and_mul(gate_up)),
            bench(lambda: K.silu_and_mul_reference(gate_up)),
            nbytes(gate_up, out),
            rel_err(out, K.silu_and_mul_reference(gate_up)),
        )
    )
    H, Hkv, D = 32, 8, 128
    qkv = torch.randn(T, (H + 2 * Hkv) * D, dtype=dtype, device=device)
    q = qkv[:, : H * D].view(T, H, D)
    k = qkv[:, H * D : (H + Hkv) * D].view(T, Hkv, D)
    positions = torch.randint(0, 4096, (T,), device=device)
    cache = torch.randn(4096, D, device=device)
    q_ref, k_ref = q.clone(), k.clone()
    K.rotary_embedding_reference(positions, q_ref, k_ref, cache, True)
    q_got, k_got = q.clone(), k.clone()
    K.rotary_embedding(positions, q_got, k_got, cache, True)
    rows.append(
        Row(
            "rotary_embedding",
            f"T={T} H={H} Hkv={Hkv} D={D}",
            bench(lambda: K.rotary_embedding(positions, q, k, cache, True)),
            bench(lambda: K.rotary_embedding_reference(positions, q, k, cache, True)),
            2 * nbytes(q, k) + T * D * 4,  # read + write q and k, one cache row per token
            max(rel_err(q_got, q_ref), rel_err(k_got, k_ref)),
        )
    )
    v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
    num_blocks = T // 16 + 8
    k_cache = torch.zeros(num_blocks, 16, Hkv, D, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * 16, device=device)[:T]
    K.store_kv(k, v, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    K.store_kv_reference(k, v, want_k, want_v, slots)
    rows.append(
        Row(
            "store_kv",
            f"T={T} Hkv={Hkv} D={D}",
            bench(lambda: K.store_kv(k, v, k_cache, v_cache, slots)),
            bench(lambda: K.store_kv_reference(k, v, k_cache, v_cache, slots)),
            2 * nbytes(k, v) + nbytes(slots),
            float(not (torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v))),
        )
    )
    return rows


def attention_batch(
    q_lens: list[int], seq_lens: list[int], H: int, Hkv: int, D: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """A step over scattered cache blocks: q (T, H, D), caches, tables, seq_lens, qsl."""
    device = q_device()
    bs = 16
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    perm = torch.randperm(num_blocks, device=device).int()
    tables = torch.full((len(seq_lens), max(blocks_per_seq)), -1, dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[start : start + n]
        start += n
    k_cache = torch.randn(num_blocks, bs, Hkv, D, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(q_lens), H, D, dtype=dtype, device=device)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q, k_cache, v_cache, tables, lens.to(device), qsl.to(device)


def q_device() -> torch.device:
    return torch.device("cuda")


def bench_attention(dtype: torch.dtype, length: int = 2048) -> list[Row]:
    """Llama-3.1-8B heads; decode batches at `length` (and 4x for the small batch)."""
    from kubeinfer import kernels as K

    H, Hkv, D = 32, 8, 128
    n = length
    cases = [
        ("decode", [1] * 64, [n] * 64, None),
        ("decode, split-KV auto", [1] * 4, [4 * n] * 4, None),
        ("decode, unsplit", [1] * 4, [4 * n] * 4, 1),
        ("prefill+decode", [n // 2, n // 2] + [1] * 62, [n // 2, 3 * n // 2] + [n] * 62, None),
    ]
    rows = []
    for name, q_lens, seq_lens, num_splits in cases:
        q, k_cache, v_cache, tables, lens, qsl = attention_batch(q_lens, seq_lens, H, Hkv, D, dtype)
        scale = D**-0.5
        info = dict(max_query_len=max(q_lens), max_seq_len=max(seq_lens), num_splits=num_splits)

        def triton_call() -> torch.Tensor:
            return K.paged_attention(q, k_cache, v_cache, tables, lens, qsl, scale, **info)  # noqa: B023

        def torch_call() -> torch.Tensor:
            return K.paged_attention_reference(q, k_cache, v_cache, tables, lens, qsl, scale)  # noqa: B023

        out = triton_call()
        ref = torch_call()
        # keys and values each sequence reads once (per KV head), plus q and out
        kv_bytes = 2 * sum(seq_lens) * Hkv * D * k_cache.element_size()
        rows.append(
            Row(
                f"paged_attention {name}",
                f"S={len(q_lens)} T={q.shape[0]} L<={max(seq_lens)} H={H} Hkv={Hkv} D={D}",
                bench(triton_call),
                bench(torch_call),
                kv_bytes + 2 * nbytes(q),
                rel_err(out, ref),
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args()
    need_gpu()
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name(device)
    bandwidth = copy_bandwidth(device)
    rows = bench_elementwise(dtype, device) + bench_attention(dtype)

    tolerance = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    header = (
        f"{'kernel':<34} {'shape':<40} {'triton':>9} {'torch':>9} {'speedup':>8} "
        f"{'floor':>9} {'of BW':>6} {'rel err':>8}"
    )
    lines = [f"{gpu}, {args.dtype}; copy bandwidth {bandwidth / 1e9:.0f} GB/s", header]
    for r in rows:
        floor_ms = r.floor_bytes / bandwidth * 1e3
        lines.append(
            f"{r.kernel:<34} {r.shape:<40} {r.ms * 1e3:>7.1f}us {r.ref_ms * 1e3:>7.1f}us "
            f"{r.ref_ms / r.ms:>7.2f}x {floor_ms * 1e3:>7.1f}us "
            f"{r.bandwidth_fraction(bandwidth):>6.0%} {r.error:>8.1e}"
        )
    decode = next(r for r in rows if r.kernel == "paged_attention decode")
    fraction = decode.bandwidth_fraction(bandwidth)
    verdict = "met" if fraction >= DECODE_GOAL else "NOT met"
    lines.append(f"goal: paged decode attention >= {DECODE_GOAL:.0%} of bandwidth: {verdict}")
    bad = [r.kernel for r in rows if not r.error < tolerance]
    if bad:
        lines.append(f"WRONG RESULTS (rel err >= {tolerance}): {', '.join(bad)}")
    print("\n".join(lines))
    if not args.no_results:
        date = dt.date.today().isoformat()
        with RESULTS.open("a") as f:
            for r in rows:
                f.write(
                    f"| {date} | gpu_kernels {r.kernel} | {gpu} {args.dtype} {r.shape} | "
                    f"{r.ms * 1e3:.1f} us, {r.bandwidth_fraction(bandwidth):.0%} of "
                    f"{bandwidth / 1e9:.0f} GB/s | torch {r.ref_ms * 1e3:.1f} us | "
                    f"{r.ref_ms / r.ms:.2f}x |\n"
                )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
