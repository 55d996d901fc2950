"""store_kv: write the step's new keys and values into the paged KV cache by slot.

slot = block_id * block_size + offset_in_block; slot -1 means "do not store" (padding).
Layouts: k, v (T, Hkv, D), each token's heads contiguous but the token stride free (views into
a fused qkv projection need no copy); k_cache, v_cache (num_blocks, block_size, Hkv, D)
contiguous; slot_mapping (T,) int64 or int32. Slots must be < num_blocks * block_size (the
Triton launcher does not check, which would need a device sync).
"""

from __future__ import annotations

import torch

from kubeinfer.kernels.checks import (
    KernelInputError,
    check_kv_cache,
    check_tensor,
    check_token_major,
)
from kubeinfer.kernels.jit import check_launchable, jit, next_power_of_2, tl


@jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_token_stride,
    v_token_stride,
    row_size,
    BLOCK: tl.constexpr,
):
    # One program per token: its Hkv * D keys and values go to cache row `slot` (flat view).
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # A skipped token (slot -1) copies nothing: its row counts as empty. (Writing the mask as
    # `(cols < row_size) & (slot >= 0)` fails in triton 3.9's interpreter: "mask has
    # unsupported dtype".)
    limit = tl.where(slot >= 0, row_size, 0)
    offs = tl.arange(0, BLOCK)
    for start in range(0, row_size, BLOCK):
        cols = start + offs
        mask = cols < limit
        k = tl.load(k_ptr + token * k_token_stride + cols, mask=mask)
        v = tl.load(v_ptr + token * v_token_stride + cols, mask=mask)
        tl.store(k_cache_ptr + slot * row_size + cols, k, mask=mask)
        tl.store(v_cache_ptr + slot * row_size + cols, v, mask=mask)


def _check(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_token_major("k", k)
    check_token_major("v", v)
    check_tensor("v", v, shape=k.shape, dtype=k.dtype, device=k.device, contiguous=False)
    check_kv_cache(k_cache, v_cache, num_kv_heads=k.shape[1], head_dim=k.shape[2], dtype=k.dtype)
    if k_cache.device != k.device:
        raise KernelInputError(f"k_cache is on {k_cache.device}, k on {k.device}")
    check_tensor(
        "slot_mapping",
        slot_mapping,
        shape=(k.shape[0],),
        dtype=(torch.int64, torch.int32),
        device=k.device,
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton, in place on the caches."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    check_launchable("k", k)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens:
        row_size = num_kv_heads * head_dim
        block = min(next_power_of_2(row_size), 4096)
        _store_kv_kernel[(num_tokens,)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k.stride(0),
            v.stride(0),
            row_size,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 8),
            enable_fp_fusion=True,
        )


def store_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Pure torch, in place on the caches."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = k.shape[1:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[keep])
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[keep])
