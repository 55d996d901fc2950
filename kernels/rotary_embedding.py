"""rotary_embedding: rotate q and k in place by their positions, from a cos/sin cache.

The cache is (max_positions, rot_dim) = cat(cos, sin) of outer(position, inv_freq), as the
model builds it; the first rot_dim (<= head_dim) features of every head rotate, the rest stay.
With c = cos[pos, i], s = sin[pos, i] for i < rot_dim / 2, each pair (x1, x2) becomes

    x1' = x1 * c - x2 * s
    x2' = x2 * c + x1 * s

where the pair is (x[i], x[i + rot_dim/2]) in the neox style (Llama as transformers ships it)
and (x[2i], x[2i + 1]) in the GPT-J style. cos and sin are rounded to q's dtype first, as the
model's torch path does; the kernel then computes in float32 and rounds once.

Layouts: positions (T,) int32/int64; q (T, H, D) and k (T, Hkv, D) with each token's heads
contiguous but the token stride free, so views into a fused qkv projection rotate in place.
Both functions return (q, k), the same tensors they rotated.
"""

from __future__ import annotations

import torch

from kubeinfer.kernels.checks import KernelInputError, check_tensor, check_token_major
from kubeinfer.kernels.jit import check_launchable, jit, next_power_of_2, tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@jit
def _rotary_embedding_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_token_stride,
    k_token_stride,
    num_heads,
    num_kv_heads,
    head_dim,
    rot_dim,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # One program per token: every q head and k head of that token, half a rotation per lane.
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    half = rot_dim // 2
    i = tl.arange(0, BLOCK_R)  # pair index
    i_mask = i < half
    cos = tl.load(cache_ptr + pos * rot_dim + i, mask=i_mask, other=0.0)
    sin = tl.load(cache_ptr + pos * rot_dim + half + i, mask=i_mask, other=0.0)
    cos = cos.to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]
    sin = sin.to(q_ptr.dtype.element_ty).to(tl.float32)[None, :]
    if IS_NEOX:
        off1 = i
        off2 = i + half
    else:
        off1 = 2 * i
        off2 = 2 * i + 1
    h = tl.arange(0, BLOCK_H)

    # q: (H, rot_dim/2) pairs
    q_mask = (h[:, None] < num_heads) & i_mask[None, :]
    q_row = q_ptr + token * q_token_stride + h[:, None] * head_dim
    x1 = tl.load(q_row + off1[None, :], mask=q_mask, other=0.0).to(tl.float32)
    x2 = tl.load(q_row + off2[None, :], mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q_row + off1[None, :], (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_row + off2[None, :], (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)

    # k: (Hkv, rot_dim/2) pairs
    k_mask = (h[:, None] < num_kv_heads) & i_mask[None, :]
    k_row = k_ptr + token * k_token_stride + h[:, None] * head_dim
    x1 = tl.load(k_row + off1[None, :], mask=k_mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_row + off2[None, :], mask=k_mask, other=0.0).to(tl.float32)
    tl.store(k_row + off1[None, :], (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k_row + off2[None, :], (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty), mask=k_mask)


def _check(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    check_token_major("q", q, dtype=FLOAT_DTYPES)
    check_token_major("k", k, dtype=FLOAT_DTYPES)
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise KernelInputError(f"k must be ({num_tokens}, Hkv, {head_dim}), got {tuple(k.shape)}")
    if k.dtype != q.dtype or k.device != q.device:
        raise KernelInputError(f"k is {k.dtype} on {k.device}, q is {q.dtype} on {q.device}")
    check_tensor(
        "positions",
        positions,
        shape=(num_tokens,),
        dtype=(torch.int32, torch.int64),
        device=q.device,
    )
    check_tensor(
        "cos_sin_cache", cos_sin_cache, ndim=2, dtype=(torch.float32, q.dtype), device=q.device
    )
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > head_dim or rot_dim == 0:
        raise KernelInputError(
            f"cos_sin_cache must be (max_positions, rot_dim) with an even rot_dim <= {head_dim}, "
            f"got {tuple(cos_sin_cache.shape)}"
        )


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton, in place on q and k. Positions must be < max_positions (not checked: no sync)."""
    _check(positions, q, k, cos_sin_cache)
    check_launchable("q", q)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens:
        rot_dim = cos_sin_cache.shape[1]
        _rotary_embedding_kernel[(num_tokens,)](
            positions,
            q,
            k,
            cos_sin_cache,
            q.stride(0),
            k.stride(0),
            num_heads,
            k.shape[1],
            head_dim,
            rot_dim,
            IS_NEOX=is_neox,
            BLOCK_H=next_power_of_2(max(num_heads, k.shape[1])),
            BLOCK_R=next_power_of_2(rot_dim // 2),
            num_warps=4,
            enable_fp_fusion=True,
        )
    return q, k


def rotary_embedding_reference(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure torch, in place on q and k, with the model's op order (all in q's dtype)."""
    _check(positions, q, k, cos_sin_cache)
    rot_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].to(q.dtype).chunk(2, dim=-1)  # (T, rot_dim/2)
    for x in (q, k):
        rot = x[..., :rot_dim]
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
        if is_neox:
            rot.copy_(torch.cat([y1, y2], dim=-1))
        else:
            rot.copy_(torch.stack([y1, y2], dim=-1).flatten(-2))
    return q, k
