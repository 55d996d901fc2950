"""The CPU paged-attention kernel (kernels/cpu/paged_attention.cpp), built on first use.

The engine's CPU path attends decodes and every sequence with cached context through this
kernel: it reads keys and values from the paged cache through the block table (no gather into a
copy), converts each once to float32 for all the query heads that share it, and spreads (sequence,
KV head, query chunk) items over ATen's threads. Fresh prefills keep SDPA's flash kernel, which
is faster for a long causal block with no cache to read.

It is a C++ extension compiled with the machine's g++ (`torch.utils.cpp_extension`, ninja) into
`~/.cache/kubeinfer/ext/<key>/`, keyed by the source, torch, Python and the CPU's flags (it is
built with `-march=native`), and loaded from there afterwards. Where it cannot be built (no
compiler) the engine says why once and keeps its pure-torch path; `KUBEINFER_CPU_KERNELS=0`
chooses that path on purpose.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path

import torch

from kubeinfer.kernels.checks import KernelInputError

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu") / "paged_attention.cpp"
_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_root() -> Path:
    base = os.environ.get("KUBEINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kubeinfer"
    )
    return Path(base) / "ext"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_key() -> str:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), sys.version.encode()):
        h.update(part)
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
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-DNDEBUG"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    else:
        torch.ops.load_library(str(lib))
    if not hasattr(torch.ops.kubeinfer_cpu, "paged_attention"):
        raise RuntimeError(f"{lib} does not define kubeinfer_cpu::paged_attention")


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
