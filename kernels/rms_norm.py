"""rms_norm: y = w * (x / sqrt(mean(x^2) + eps)), optionally after adding a residual.

Numerics follow transformers' LlamaRMSNorm, which the model's parity tests hold us to: the
mean of squares and the scaling are float32, the normalized row is rounded to x's dtype, and
only then multiplied by the weight (rounded again). With a residual, the sum x + residual is
rounded to x's dtype first (as the model's `residual + hidden` is), becomes the new residual,
and is what gets normalized (vLLM's fused_add_rms_norm, but out of place: inputs are never
written).

Layouts: x and residual (..., N), contiguous; weight (N,); all of one dtype.
"""

from __future__ import annotations

from typing import overload

import torch

from kubeinfer.kernels.checks import KernelInputError, check_tensor
from kubeinfer.kernels.jit import check_launchable, jit, next_power_of_2, tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HIDDEN = 65536  # one row lives in one program's registers


@jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row; the whole row is one block.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * n_cols + cols, mask=mask, other=0.0)
        # z = x + r, rounded to the activation dtype: the new residual, and what is normalized
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * n_cols + cols, x, mask=mask)
    h = x.to(tl.float32)
    # inv_rms = 1 / sqrt(sum(h^2) / N + eps); padded columns load 0 and add nothing
    inv_rms = tl.math.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = (h * inv_rms).to(x_ptr.dtype.element_ty)  # rounded before the weight, as transformers
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _result(name: str, given: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if given is None:
        return torch.empty_like(like)
    check_tensor(name, given, shape=like.shape, dtype=like.dtype, device=like.device)
    return given


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    check_tensor("x", x, dtype=FLOAT_DTYPES)
    if x.ndim == 0:
        raise KernelInputError("x must have at least one dimension")
    check_tensor("weight", weight, shape=(x.shape[-1],), dtype=x.dtype, device=x.device)
    if residual is not None:
        check_tensor("residual", residual, shape=x.shape, dtype=x.dtype, device=x.device)


@overload
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor: ...


@overload
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton. Returns `out`, or `(out, new_residual)` when a residual is given. `out` and
    `residual_out` are optional preallocated results (x's shape); they may alias x and residual,
    which makes the call in place (each row is read whole before it is written)."""
    _check(x, weight, residual)
    n_cols = x.shape[-1]
    if n_cols > MAX_HIDDEN:
        raise KernelInputError(f"x rows of {n_cols} exceed the kernel's {MAX_HIDDEN}")
    num_rows = x.numel() // n_cols if n_cols else 0
    out = _result("out", out, x)
    new_residual = _result("residual_out", residual_out, x) if residual is not None else None
    check_launchable("x", x)
    if num_rows:
        block = next_power_of_2(n_cols)
        _rms_norm_kernel[(num_rows,)](
            x,
            residual if residual is not None else x,  # unread without HAS_RESIDUAL
            weight,
            out,
            new_residual if new_residual is not None else out,
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
            enable_fp_fusion=True,
        )
    return out if new_residual is None else (out, new_residual)


@overload
def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None
) -> torch.Tensor: ...


@overload
def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pure torch, the same contract as `rms_norm`."""
    _check(x, weight, residual)
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)
