"""Input checks shared by the kernel launchers and references: a clear error, never a crash."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KernelInputError(ValueError):
    """A kernel was called with a tensor of the wrong shape, dtype, device or layout."""


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int | None = None,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    contiguous: bool = True,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.ndim != ndim:
        raise KernelInputError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise KernelInputError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            raise KernelInputError(
                f"{name} must be {' or '.join(map(str, allowed))}, got {t.dtype}"
            )
    if device is not None and t.device != device:
        raise KernelInputError(f"{name} is on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise KernelInputError(f"{name} must be contiguous")


def check_kv_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> None:
    check_tensor("k_cache", k_cache, ndim=4, dtype=dtype)
    check_tensor(
        "v_cache", v_cache, ndim=4, shape=k_cache.shape, dtype=dtype, device=k_cache.device
    )
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise KernelInputError(
            f"k_cache must be (num_blocks, block_size, {num_kv_heads}, {head_dim}), "
            f"got {tuple(k_cache.shape)}"
        )


def check_token_major(
    name: str,
    t: torch.Tensor,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
) -> None:
    """(T, heads, head_dim) with each token's (heads, head_dim) contiguous; the token stride may
    be anything, so views into a fused qkv projection pass without a copy."""
    check_tensor(name, t, ndim=3, dtype=dtype, contiguous=False)
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        raise KernelInputError(
            f"{name} must have each token's (heads, head_dim) contiguous, got shape "
            f"{tuple(t.shape)} with strides {t.stride()}"
        )
