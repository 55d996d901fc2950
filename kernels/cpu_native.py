"""The engine's C++ kernels for CPU (kernels/cpu/), built on first use: paged attention, and
the elementwise ops (RMSNorm, SiLU-and-mul, rotary, the KV store) in one pass each.

The engine's CPU path attends decodes and every sequence with cached context through this
kernel: it reads keys and values from the paged cache through the block table (no gather into a
copy), each key and value once for all the query heads that share it, and spreads (sequence,
query chunk) items over ATen's threads. For head dims 64 and 128 with AVX-512 it takes the scores
straight from the cache's type (bfloat16 dot products where the CPU has them) and accumulates
the values in registers; for prefill chunks (float32, and bfloat16 with AVX512_BF16) it puts
the rows in the vector lanes instead, 1.5-3x faster, and faster than SDPA's flash kernel at
every length measured, so fresh prefills go through it too (runtime/engine/attention.py). With
AVX2 and no AVX-512 (head dims 64 and 128) it widens each cache block to float once for all
the rows that read it, sums 8 keys' dot products across lanes together and keeps each row's
value accumulators in registers: 1.4-3.4x the portable path's speed, and fresh prefills of up to
512 tokens 1.5-2x SDPA's.

It is a C++ extension compiled with the machine's g++ (`torch.utils.cpp_extension`, ninja) into
`~/.cache/kubeinfer/ext/<key>/`, keyed by the source, torch, Python and the CPU's flags (it is
built with `-march=native`), and loaded from there afterwards. Where it cannot be built (no
compiler) the engine says why once and keeps its pure-torch path; `KUBEINFER_CPU_KERNELS=0`
chooses that path on purpose.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path

import torch

from kubeinfer.kernels.checks import KernelInputError
from kubeinfer.kernels.rms_norm import rms_norm_reference
from kubeinfer.kernels.rotary_embedding import rotary_embedding_reference
from kubeinfer.kernels.silu_and_mul import silu_and_mul_reference
from kubeinfer.kernels.store_kv import store_kv_reference

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("cpu") / f for f in ("paged_attention.cpp", "elementwise.cpp")]
HEADERS = [Path(__file__).with_name("cpu") / "common.h"]
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-DNDEBUG"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_root() -> Path:
    base = os.environ.get("KUBEINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kubeinfer"
    )
    return Path(base) / "ext"


@functools.cache
def _cpu_flags() -> str:
    """The CPU's flags line, read once: the engine asks for every step (`rows_in_lanes`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def rows_in_lanes(dtype: torch.dtype) -> bool:
    """The kernel attends prefill chunks of `dtype` with the rows in the vector lanes
    (`attend_rows`, head dims 64 and 128): float32 where the CPU has AVX-512, bfloat16 where it
    has AVX512_BF16 too (it is built with -march=native)."""
    flags = _cpu_flags().split()
    if dtype == torch.float32:
        return "avx512f" in flags
    return dtype == torch.bfloat16 and "avx512f" in flags and "avx512_bf16" in flags


def build_key() -> str:
    h = hashlib.sha256()
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS), torch.__version__.encode()):
        h.update(part)
    h.update(sys.version.encode())
    h.update(" ".join(CFLAGS).encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def enabled() -> bool:
    return os.environ.get("KUBEINFER_CPU_KERNELS", "1").lower() not in ("0", "false", "off", "no")


def load() -> bool:
    """Build (once per machine) and load the kernel; False, with the reason logged once, where it
    cannot be."""
    if "ok" in _state:
        return bool(_state["ok"])
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        if not enabled():
            _state["ok"] = False
            return False
        try:
            _build_and_load()
            _state["ok"] = True
        except Exception as e:  # noqa: BLE001 - any build failure leaves the torch path
            _state["ok"] = False
            _state["error"] = f"{type(e).__name__}: {e}"
            logger.warning(
                "the CPU attention kernel could not be built (%s); using the pure-torch path",
                _first_error(str(e)) or type(e).__name__,
            )
        return bool(_state["ok"])


def _first_error(text: str) -> str:
    """The compiler's first error line, else the message's last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [""])[0 if errors else -1]


def load_error() -> str | None:
    return _state.get("error")  # type: ignore[return-value]


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    key = build_key()
    build_dir = cache_root() / key
    build_dir.mkdir(parents=True, exist_ok=True)
    name = f"kubeinfer_cpu_{key}"
    lib = build_dir / f"{name}.so"
    if not lib.exists():
        logger.info("building the CPU attention kernel into %s (once per machine)", build_dir)
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    else:
        torch.ops.load_library(str(lib))
    ops = ("paged_attention", "rms_norm", "rms_norm_add", "silu_and_mul", "rotary_neox", "store_kv")
    for op in ops:
        if not hasattr(torch.ops.kubeinfer_cpu, op):
            raise RuntimeError(f"{lib} does not define kubeinfer_cpu::{op}")


def paged_attention_cpu(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_ids: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> None:
    """Attend the sequences `seq_ids` of the step into their rows of `out`, in place.

    Arguments as `paged_attention`'s (int32 metadata), plus `seq_ids` (int32): the sequences to
    compute. Raises `KernelInputError` if the kernel is not available."""
    if not load():
        raise KernelInputError(f"the CPU attention kernel is not available: {load_error()}")
    torch.ops.kubeinfer_cpu.paged_attention(
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        seq_ids,
        float(scale),
        int(sliding_window or 0),
    )


def rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_reference` in one pass; with `residual`, the add and the norm in that pass."""
    if x.ndim != 2 or not x.is_contiguous():
        return rms_norm_reference(x, weight, eps, residual)
    out = torch.empty_like(x)
    if residual is None:
        torch.ops.kubeinfer_cpu.rms_norm(out, x, weight, float(eps))
        return out
    if residual.shape != x.shape or residual.dtype != x.dtype:
        return rms_norm_reference(x, weight, eps, residual)  # it names what is wrong
    new_residual = torch.empty_like(x)
    torch.ops.kubeinfer_cpu.rms_norm_add(
        out, new_residual, x, residual.contiguous(), weight, float(eps)
    )
    return out, new_residual


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul_reference` in one pass."""
    if x.ndim != 2 or not x.is_contiguous():
        return silu_and_mul_reference(x)
    out = x.new_empty(x.shape[0], x.shape[1] // 2)
    torch.ops.kubeinfer_cpu.silu_and_mul(out, x)
    return out


def rotary_embedding_cpu(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding_reference` (neox layout) in one pass, in place on q and k."""
    if not is_neox or cos_sin_cache.dtype != torch.float32 or q.stride(2) != 1:
        return rotary_embedding_reference(positions, q, k, cos_sin_cache, is_neox)
    torch.ops.kubeinfer_cpu.rotary_neox(positions.long().contiguous(), q, k, cos_sin_cache)
    return q, k


def store_kv_cpu(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`store_kv_reference` in one call: rows copied by slot, -1 skipped, a slot past the cache
    an error before anything is written."""
    if k.stride(1) != k.shape[2] or v.stride(1) != v.shape[2] or k.stride(2) != 1:
        return store_kv_reference(k, v, k_cache, v_cache, slot_mapping)
    try:
        torch.ops.kubeinfer_cpu.store_kv(k, v, k_cache, v_cache, slot_mapping)
    except RuntimeError as e:
        raise KernelInputError(str(e).splitlines()[0]) from e
