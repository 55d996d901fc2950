"""store_kv (Triton) against store_kv_reference: written slots equal, every other slot untouched."""

from __future__ import annotations

import pytest
import torch

from kubeinfer.kernels import KernelInputError, store_kv, store_kv_reference


@pytest.mark.parametrize(("kv_heads", "head_dim"), [(1, 64), (2, 128), (8, 128)])
def test_store_kv_matches_reference(
    backend: tuple[torch.device, torch.dtype], kv_heads: int, head_dim: int
) -> None:
    device, dtype = backend
    g = torch.Generator().manual_seed(kv_heads)
    num_blocks, block_size, num_tokens = 6, 16, 9
    # k and v as views into a fused qkv row (token stride > Hkv * D)
    qkv = torch.randn(num_tokens, 3 * kv_heads * head_dim, generator=g).to(device, dtype)
    k = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(-1, kv_heads, head_dim)
    v = qkv[:, 2 * kv_heads * head_dim :].view(-1, kv_heads, head_dim)
    slots = torch.tensor([0, 15, 16, -1, 17, 95, 40, -1, 33], device=device)  # -1: padding
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    store_kv_reference(k, v, k_want, v_want, slots)
    store_kv(k, v, k_cache, v_cache, slots.int())
    torch.testing.assert_close(k_cache, k_want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_want, rtol=0, atol=0, equal_nan=True)
    assert int(k_cache.isnan().any(-1).any(-1).sum()) == num_blocks * block_size - 7


def test_store_kv_rejects_bad_inputs() -> None:
    k = torch.randn(3, 2, 8)
    cache = torch.zeros(4, 16, 2, 8)
    for fn in (store_kv, store_kv_reference):
        with pytest.raises(KernelInputError, match="slot_mapping must be"):
            fn(k, k, cache, cache.clone(), torch.zeros(3))
        with pytest.raises(KernelInputError, match="k_cache must be"):
            fn(k, k, torch.zeros(4, 16, 1, 8), torch.zeros(4, 16, 1, 8), torch.arange(3))
        with pytest.raises(KernelInputError, match="v must have shape"):
            fn(k, k[:2], cache, cache.clone(), torch.arange(3))
