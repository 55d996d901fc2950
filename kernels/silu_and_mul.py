"""silu_and_mul: the SwiGLU gate on a fused gate_up projection, (..., 2I) -> (..., I).

    out = silu(gate) * up,   silu(g) = g * sigmoid(g) = g / (1 + exp(-g))

with gate = x[..., :I] and up = x[..., I:]. silu is computed in float32 and rounded to x's dtype
before the product (rounded again), which is what torch's `F.silu(gate) * up` does, so the model's
torch path and this kernel differ only by the exp implementation.
"""

from __future__ import annotations

import torch

from kubeinfer.kernels.checks import KernelInputError, check_tensor
from kubeinfer.kernels.jit import check_launchable, jit, tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = 1024


@jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter_size, BLOCK: tl.constexpr):
    # grid (rows, cdiv(I, BLOCK)): one chunk of one row each
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    gate = tl.load(x_ptr + row * 2 * inter_size + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter_size + inter_size + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * inter_size + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor) -> None:
    check_tensor("x", x, dtype=FLOAT_DTYPES)
    if x.ndim == 0 or x.shape[-1] % 2:
        raise KernelInputError(f"x must be (..., 2 * I), got {tuple(x.shape)}")


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: (..., 2I) -> (..., I), into `out` when given (preallocated, contiguous)."""
    _check(x)
    inter_size = x.shape[-1] // 2
    if out is None:
        out = x.new_empty(*x.shape[:-1], inter_size)
    else:
        check_tensor("out", out, shape=(*x.shape[:-1], inter_size), dtype=x.dtype, device=x.device)
    check_launchable("x", x)
    num_rows = out.numel() // inter_size if inter_size else 0
    if num_rows:
        grid = (num_rows, (inter_size + BLOCK - 1) // BLOCK)
        _silu_and_mul_kernel[grid](
            x, out, inter_size, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=True
        )
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Pure torch: (..., 2I) -> (..., I)."""
    _check(x)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
