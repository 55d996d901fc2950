"""paged_attention: one step's attention over the paged KV cache, prefill chunks and decodes mixed.

Layouts (DESIGN.md, Kernels): q (T, H, D) holds the step's new tokens grouped by sequence per
`query_start_loc` (S + 1,); each cache is (num_blocks, block_size, Hkv, D); `block_tables`
(S, max_blocks) int32 maps a sequence's logical blocks to cache blocks; `seq_lens` (S,) int32
counts each sequence's tokens including the new ones, which are its last and attend causally:
new token j of sequence i sits at position p = seq_lens[i] - q_len_i + j and sees keys 0..p
(or p - sliding_window + 1 .. p). H is a multiple of Hkv (grouped-query attention). q's token
stride is free (each token's (H, D) contiguous); the output is contiguous, q's shape and dtype.

    out = softmax(q k^T * scale + mask) v

The Triton path is one varlen kernel (after vLLM's unified Triton attention). A program owns
BLOCK_Q consecutive new tokens of one sequence times the G = H / Hkv query heads that share one
KV head, packed into BLOCK_M = BLOCK_Q * G rows, so every key and value tile it loads from the
cache serves all G heads. Programs find their sequence by a binary search over
`query_start_loc`, so the grid needs no host copy of the step's layout. It walks the keys a tile
at a time with the online softmax (in base 2: x * scale * log2(e), exp2):

    m' = max(m, max_j s_j);  l' = l * 2^(m - m') + sum_j 2^(s_j - m');
    acc' = acc * 2^(m - m') + sum_j 2^(s_j - m') v_j;  out = acc / l

Split-KV (for decode batches too small to fill the GPU): a third grid axis cuts each program's
key range into NUM_SPLITS parts, each writing its normalized partial output o_s and its
log-sum-exp lse_s = m_s + log2(l_s) in float32; a second kernel merges them exactly:

    out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),  M = max_s lse_s

A split that sees no key of a row (all its keys lie past the row's position or outside the
window) stores lse = -inf and o = 0, which the merge weighs at zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kubeinfer.kernels.checks import (
    KernelInputError,
    check_kv_cache,
    check_tensor,
    check_token_major,
)
from kubeinfer.kernels.jit import check_launchable, jit, next_power_of_2, tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE = 32  # keys per inner step, independent of the cache's block size
MAX_SPLITS = 32
MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost outweighs its parallelism
LOG2E = 1.4426950408889634  # scores go to base 2: e^x = 2^(x log2 e)


@jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    num_seqs,
    num_tokens,
    num_heads,
    q_token_stride,
    block_table_stride,
    block_size,
    sliding_window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = num_heads // GROUP
    kv_row_size = num_kv_heads * HEAD_DIM

    # Sequence i owns q blocks [start_i, start_{i+1}) with start_i = qsl[i] // BLOCK_Q + i, enough
    # for cdiv(q_len_i, BLOCK_Q) blocks; the grid's T // BLOCK_Q + S blocks cover every sequence.
    # Find the last i with start_i <= q_block.
    left: tl.int32 = 0
    right: tl.int32 = num_seqs
    while left < right:
        mid = (left + right) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            left = mid + 1
        else:
            right = mid
    seq = left - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return  # a spare block of this sequence
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # rows: token (row // GROUP) of this block, query head kv_head * GROUP + row % GROUP
    rows = tl.arange(0, BLOCK_M)
    tok = local_block * BLOCK_Q + rows // GROUP  # index among the sequence's new tokens
    head = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    pos = context_len + tok  # each row's position in its sequence
    token = (q_start + tok).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * q_token_stride + head[:, None] * HEAD_DIM + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # (BLOCK_M, HEAD_DIM_PAD)

    # keys this block needs: up to its last row's position, from its first row's window start
    kv_end = tl.minimum(seq_len, context_len + (local_block + 1) * BLOCK_Q)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + local_block * BLOCK_Q - sliding_window + 1, 0)
    tile_lo = kv_start // TILE
    tile_hi = (kv_end + TILE - 1) // TILE
    tiles_per_split = (tile_hi - tile_lo + NUM_SPLITS - 1) // NUM_SPLITS
    tile_begin = tile_lo + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    for t in range(tile_begin, tile_end):
        key_pos = t * TILE + tl.arange(0, TILE)  # (TILE,)
        key_in = key_pos < kv_end
        block = tl.load(table + key_pos // block_size, mask=key_in, other=0).to(tl.int64)
        slot = block * block_size + key_pos % block_size
        kv_off = slot * kv_row_size + kv_head * HEAD_DIM
        kv_mask = key_in[:, None] & dim_mask[None, :]
        k_t = tl.load(
            k_cache_ptr + kv_off[None, :] + dims[:, None],
            mask=dim_mask[:, None] & key_in[None, :],
            other=0.0,
        )  # (HEAD_DIM_PAD, TILE), already transposed
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)

        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, TILE), base 2
        visible = key_in[None, :] & (key_pos[None, :] <= pos[:, None])
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row with no visible key yet keeps m = -inf; shift it by 0 so 2^(-inf - 0) = 0
        # instead of 2^(-inf + inf) = nan
        m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_mask[:, None] & dim_mask[None, :]
    has_keys = l_i > 0.0  # false only on masked rows, or in a split that saw no key of the row
    l_safe = tl.where(has_keys, l_i, 1.0)
    if NUM_SPLITS == 1:
        out = acc / l_safe[:, None]
        out_off = token[:, None] * (num_heads * HEAD_DIM) + head[:, None] * HEAD_DIM
        tl.store(out_ptr + out_off + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        out = acc / l_safe[:, None]  # 0 where the split saw no key
        lse = tl.where(has_keys, m_i + tl.math.log2(l_safe), float("-inf"))
        part_row = (split * num_tokens + token) * num_heads + head  # (NUM_SPLITS, T, H) flat
        tl.store(part_lse_ptr + part_row, lse, mask=row_mask)
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)


@jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_tokens,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    # One program per (token, head): out = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max lse)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    part_row = (splits * num_tokens + token) * num_heads + head  # (SPLITS_PAD,)
    lse = tl.load(part_lse_ptr + part_row, mask=splits < NUM_SPLITS, other=float("-inf"))
    w = tl.math.exp2(lse - tl.max(lse, axis=0))  # every row sees its own key: max is finite
    o = tl.load(
        part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :],
        mask=(splits[:, None] < NUM_SPLITS) & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )  # (SPLITS_PAD, HEAD_DIM_PAD)
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(
        out_ptr + (token * num_heads + head) * HEAD_DIM + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def check_paged_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    check_token_major("q", q, dtype=FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, ndim=4)
    num_kv_heads = k_cache.shape[2]
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


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton, into `out` when given (preallocated, q's shape and dtype, contiguous).

    `max_query_len` and `max_seq_len` are the step's longest new-token run and sequence, which
    the runner knows on the host; when left out they are read from the device (a sync).
    `num_splits` forces the split-KV path (1 = never split); by default it is used for
    decode-only steps with too few (sequence, KV head) programs to fill the GPU. The layout is
    trusted beyond shapes and dtypes: query_start_loc must start at 0, end at T and increase,
    each q length must be <= its seq_len, and the block tables must cover every sequence."""
    check_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if sliding_window is not None and sliding_window < 1:
        raise KernelInputError(f"sliding_window must be >= 1, got {sliding_window}")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise KernelInputError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:
        check_tensor("out", out, shape=q.shape, dtype=q.dtype, device=q.device)
    check_launchable("q", q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    if num_splits is None:
        num_splits = _auto_num_splits(
            q, seq_lens, num_seqs * num_kv_heads, max_query_len, max_seq_len, sliding_window
        )

    # BLOCK_M rows = BLOCK_Q tokens x G heads; tl.dot needs >= 16 rows. Decode-sized runs take
    # the smallest block (fewer idle rows), prefill chunks a larger one (more reuse per key tile).
    block_m = max(16 if max_query_len * group <= 16 else 64, next_power_of_2(group))
    block_q = block_m // group
    num_q_blocks = num_tokens // block_q + num_seqs
    if num_splits > 1:
        part_out = torch.empty(
            (num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device
        )
    else:
        part_out = part_lse = out  # unused
    head_dim_pad = max(next_power_of_2(head_dim), 16)
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        num_seqs,
        num_tokens,
        num_heads,
        q.stride(0),
        block_tables.stride(0),
        k_cache.shape[1],
        sliding_window or 0,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE=TILE,
        NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
        enable_fp_fusion=True,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out,
            part_lse,
            out,
            num_tokens,
            num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=next_power_of_2(num_splits),
            num_warps=4,
            enable_fp_fusion=True,
        )
    return out


def _auto_num_splits(
    q: torch.Tensor,
    seq_lens: torch.Tensor,
    num_programs: int,
    max_query_len: int,
    max_seq_len: int | None,
    sliding_window: int | None,
) -> int:
    """Split only decode-only steps whose (sequence, KV head) programs leave SMs idle (aiming at
    two programs per SM), and only as far as each split keeps MIN_KEYS_PER_SPLIT keys."""
    if max_query_len != 1 or q.device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    if num_programs >= num_sms:
        return 1
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    num_keys = min(max_seq_len, sliding_window or max_seq_len)
    by_occupancy = -(-2 * num_sms // num_programs)
    by_length = max(num_keys // MIN_KEYS_PER_SPLIT, 1)
    return max(min(by_occupancy, by_length, MAX_SPLITS), 1)


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
