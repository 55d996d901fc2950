"""paged_attention: one step's attention over the paged KV cache, prefill chunks and decodes mixed.

Layouts (DESIGN.md, Kernels): q (T, H, D) holds the step's new tokens grouped by sequence per
`query_start_loc` (S + 1,); each cache is (num_blocks, block_size, Hkv, D); `block_tables`
(S, max_blocks) int32 maps a sequence's logical blocks to cache blocks; `seq_lens` (S,) int32
counts each sequence's tokens including the new ones, which are its last and attend causally:
new token j of sequence i sits at position p = seq_lens[i] - q_len_i + j and sees keys 0..p
(or p - sliding_window + 1 .. p). H is a multiple of Hkv (grouped-query attention).

    out = softmax(q k^T * scale + mask) v
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kubeinfer.kernels.checks import KernelInputError, check_kv_cache, check_tensor


def check_paged_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    check_tensor("q", q, ndim=3, dtype=(torch.float32, torch.float16, torch.bfloat16))
    num_kv_heads, head_dim = k_cache.shape[2:] if k_cache.ndim == 4 else (0, 0)
    check_kv_cache(k_cache, v_cache, num_kv_heads=num_kv_heads, head_dim=q.shape[2], dtype=q.dtype)
    if k_cache.device != q.device:
        raise KernelInputError(f"k_cache is on {k_cache.device}, q on {q.device}")
    if q.shape[1] % num_kv_heads:
        raise KernelInputError(f"q has {q.shape[1]} heads, not a multiple of {num_kv_heads}")
    check_tensor("block_tables", block_tables, ndim=2, dtype=torch.int32, device=q.device)
    num_seqs = block_tables.shape[0]
    check_tensor("seq_lens", seq_lens, shape=(num_seqs,), dtype=torch.int32, device=q.device)
    check_tensor(
        "query_start_loc",
        query_start_loc,
        shape=(num_seqs + 1,),
        dtype=torch.int32,
        device=q.device,
    )
    del head_dim


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Pure torch. Decodes (one new token) are batched into one masked SDPA call; every
    sequence with several new tokens (a prefill chunk) gets its own call."""
    check_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    if any(n < 0 for n in q_lens) or any(n > L for n, L in zip(q_lens, lens, strict=True)):
        raise KernelInputError("query_start_loc must increase and q lengths must be <= seq_lens")
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    if decodes:
        rows = torch.tensor([starts[i] for i in decodes], device=q.device)
        idx = torch.tensor(decodes, device=q.device)
        k, v, valid = _gather(k_cache, v_cache, block_tables[idx], seq_lens[idx])
        # valid: (S, L); the one query sits at the last position and sees all valid keys
        mask = valid
        if sliding_window is not None:
            pos = torch.arange(valid.shape[1], device=q.device)
            mask = mask & (pos[None, :] > seq_lens[idx, None] - 1 - sliding_window)
        o = _sdpa(q[rows].unsqueeze(1), k, v, mask.unsqueeze(1), scale)  # (S, 1, H, D)
        out[rows] = o[:, 0]
    for i, n in enumerate(q_lens):
        if n <= 1:
            continue
        seq_len = lens[i]
        k, v, _ = _gather(k_cache, v_cache, block_tables[i : i + 1], seq_lens[i : i + 1])
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        diff = q_pos[:, None] - k_pos[None, :]  # (n, L)
        mask = diff >= 0
        if sliding_window is not None:
            mask = mask & (diff < sliding_window)
        out[starts[i] : starts[i + 1]] = _sdpa(
            q[starts[i] : starts[i + 1]].unsqueeze(0), k, v, mask.unsqueeze(0), scale
        )[0]
    return out


def _gather(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys and values of each sequence, padded to the longest: (S, L, Hkv, D) and a (S, L) mask."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    max_len = int(seq_lens.max().item())
    pos = torch.arange(max_len, device=k_cache.device)
    blocks = block_tables[:, pos // block_size].long().clamp(min=0)  # (S, L)
    slots = blocks * block_size + pos % block_size
    valid = pos[None, :] < seq_lens[:, None]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    return flat_k[slots], flat_v[slots], valid


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (S, n, H, D), k/v (S, L, Hkv, D), mask (S, n, L) -> (S, n, H, D)."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask.unsqueeze(1),
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return o.transpose(1, 2)
