"""The CPU engine's memory settings, which must be in place before the process starts:
`kubeinfer serve` and `generate` re-exec themselves once with them.

- tcmalloc in LD_PRELOAD, as vLLM's CPU docs advise, when the machine has it (Debian's
  `libtcmalloc-minimal4`, which the runtime image installs). glibc's malloc returns the engine's
  many short-lived step tensors to the kernel and faults them back in; tcmalloc keeps them.
  Measured on the dev machine (bench/peer_vllm.py's 64 requests, SmolLM2-135M bfloat16): 6-9 %
  more output tokens/s. `KUBEINFER_TCMALLOC=0` keeps glibc's; an LD_PRELOAD that already names a
  malloc (tcmalloc, jemalloc, mimalloc) is left alone.
- `THP_MEM_ALLOC_ENABLE=1`: torch puts every CPU allocation of 2 MiB or more (the weights,
  oneDNN's packed copies, the KV cache) on transparent huge pages (2 MiB-aligned, advised
  MADV_HUGEPAGE; Linux's default THP mode `madvise` gives them only when asked). A decode step
  reads the weights and every running sequence's scattered KV blocks: with 4 KiB pages each
  block costs a TLB miss and the hardware prefetchers stop at every page boundary. Measured on
  the dev machine (24 requests, bfloat16, five alternating pairs): 2-10 % more output tokens/s,
  every pair faster. A value already in the environment (`THP_MEM_ALLOC_ENABLE=0`) is kept.
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)
MARK = "KUBEINFER_TCMALLOC_REEXEC"
"""Set in the re-exec'd process: it never re-execs again, whatever LD_PRELOAD became."""
MALLOCS = ("tcmalloc", "jemalloc", "mimalloc")
THP = "THP_MEM_ALLOC_ENABLE"
"""torch's switch (c10's CPU allocator) for huge-page-backed allocations of 2 MiB or more."""


def find_tcmalloc() -> str | None:
    for path in CANDIDATES:
        if Path(path).exists():
            return path
    name = ctypes.util.find_library("tcmalloc_minimal")
    return name if name and Path(name).is_absolute() else None


def preload_env(env: Mapping[str, str], lib: str | None) -> dict[str, str] | None:
    """The environment to re-exec with, or None when there is nothing to do."""
    if MARK in env:
        return None
    new = dict(env)
    off = env.get("KUBEINFER_TCMALLOC", "1").strip().lower() in ("0", "false", "off", "no")
    preload = env.get("LD_PRELOAD", "")
    if lib is not None and not off and not any(m in preload for m in MALLOCS):
        new["LD_PRELOAD"] = ":".join(p for p in (lib, preload) if p)
    new.setdefault(THP, "1")
    if new == env:
        return None
    new[MARK] = "1"
    return new


def reexec_with_tcmalloc() -> None:
    """Replace this process (same pid, same argv) by one with tcmalloc preloaded and torch's
    huge-page allocations on, where that applies; return otherwise."""
    env = preload_env(os.environ, find_tcmalloc())
    if env is None:
        return
    argv = list(getattr(sys, "orig_argv", [])) or [sys.executable, *sys.argv]
    logger.debug("re-exec with LD_PRELOAD=%s %s=%s", env.get("LD_PRELOAD"), THP, env[THP])
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError as e:  # keep running with glibc's malloc
        logger.warning("could not re-exec with tcmalloc (%s); continuing without it", e)
