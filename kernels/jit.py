"""Triton behind a guard: the kernel modules import, and their references run, without triton.

Kernel modules decorate with `jit` and take `tl` from here. Without triton, `tl` is None and a
`jit` kernel raises `KernelInputError` when launched; the modules use
`from __future__ import annotations`, so `BLOCK: tl.constexpr` stays a string (triton reads it
that way) and never touches `tl` at import.

Compiled or interpreted is a per-process choice, fixed when triton is first imported: triton
decorates its own library functions (`tl.sum`, `tl.max`, `tl.sigmoid`, ...) at import, in the
mode TRITON_INTERPRET asks for then. Changing the variable later breaks both ways (triton 3.9):
an interpreted launch after a compiled-mode import fails with `RuntimeError("Cannot call
@triton.jit'd outside of the scope of a kernel")`, and compiling after an interpreter-mode import
fails an `assert knobs.runtime.interpret or isinstance(fn, JITFunction)`. So the mode is read
once, here, and the tests run the interpreter in a subprocess of its own.

Launches pass `enable_fp_fusion=True` (multiply-adds fused) explicitly: triton 3.9 warns when it
is left to the default, which it says 3.10 flips.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from kubeinfer.kernels.checks import KernelInputError

try:
    import triton
    import triton.language as tl
except ImportError:  # the references still work; a Triton launch says why it can't
    triton = None
    tl = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

__all__ = ["check_launchable", "has_triton", "is_interpreting", "jit", "next_power_of_2", "tl"]


def has_triton() -> bool:
    return triton is not None


def is_interpreting() -> bool:
    """True when this process runs Triton kernels in triton's interpreter (on CPU tensors)."""
    return triton is not None and _INTERPRET


class _Unavailable:
    """Stands in for a kernel when triton is not installed."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.__name__ = fn.__name__

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        raise KernelInputError(f"{self.__name__} needs triton, which is not installed")


def jit(fn: Callable[..., None]) -> Any:
    """`triton.jit` when triton is installed."""
    return triton.jit(fn) if triton is not None else _Unavailable(fn)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_launchable(name: str, t: torch.Tensor) -> None:
    """A Triton launch needs triton, and CUDA tensors unless the interpreter is on."""
    if triton is None:
        raise KernelInputError(f"the Triton kernels need triton, which is not installed ({name})")
    if t.device.type != "cuda" and not _INTERPRET:
        raise KernelInputError(
            f"{name} is on {t.device}: the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 "
            "set before triton is imported, to run them in triton's interpreter); "
            "use the *_reference functions on CPU"
        )
