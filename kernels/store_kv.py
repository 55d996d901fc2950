"""store_kv: write the step's new keys and values into the paged KV cache by slot.

slot = block_id * block_size + offset_in_block; slot -1 means "do not store" (padding).
Layouts: k, v (T, Hkv, D); k_cache, v_cache (num_blocks, block_size, Hkv, D).
"""

from __future__ import annotations

import torch

from kubeinfer.kernels.checks import check_kv_cache, check_tensor


def store_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_tensor("k", k, ndim=3)
    check_tensor("v", v, ndim=3, shape=k.shape, dtype=k.dtype, device=k.device)
    check_kv_cache(k_cache, v_cache, num_kv_heads=k.shape[1], head_dim=k.shape[2], dtype=k.dtype)
    check_tensor("slot_mapping", slot_mapping, ndim=1, shape=(k.shape[0],), device=k.device)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = k.shape[1:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[keep])
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[keep])
