"""PagedAttention: the engine's attention backend for one step, over the paged KV cache.

Every layer stores the step's new k/v by slot, then attends. With the Triton kernels the whole
step is one varlen launch. With the torch references (CPU) the step is planned once, shared by
every layer, as one SDPA call per sequence over exactly its keys:

- a sequence whose new tokens are all of it (a first prefill chunk, no cached context) attends
  over its own new k/v with causal SDPA, never reading the cache;
- any other (a decode, a later chunk, a prefix-cache hit) reads its blocks from the cache: a
  view when its blocks are consecutive, else one `index_select` of whole blocks, cut to its
  length, so no key is padded or masked out and the copy is small enough to stay in cache.

A padded batch (every sequence gathered to the longest, then one masked SDPA, as
`paged_attention_reference` does) costs several times more on CPU: the copy is a fresh
allocation of S * max_len rows per layer, paid in page faults and memory traffic, and the
padding is computed and thrown away. Both compute softmax(q k^T * scale + mask) v over the same
keys; tests/runtime/test_paged_attention_cpu.py checks this path against the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kubeinfer.runtime.engine.batch import StepBatch
from kubeinfer.runtime.models.ops import TORCH_OPS, KernelOps


@dataclass(slots=True)
class _SeqPlan:
    """One sequence's share of a CPU step: its rows in the flat batch and where its keys are."""

    start: int
    end: int
    seq_len: int
    blocks: slice | torch.Tensor | None
    """Its cache blocks (a slice when consecutive); None: fresh, it attends over its new k/v."""
    mask: torch.Tensor | None
    """(q_len, seq_len) True where a query sees a key; None: all keys (or plain causal)."""
    is_causal: bool


def plan_sequences(batch: StepBatch, block_size: int, sliding_window: int | None) -> list[_SeqPlan]:
    """Per-sequence SDPA arguments for the step, computed once and shared by every layer."""
    starts = batch.query_start_loc.tolist()
    seq_lens = batch.seq_lens.tolist()
    plans = []
    for i, seq_len in enumerate(seq_lens):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        blocks: slice | torch.Tensor | None = None
        if q_len != seq_len:
            num_blocks = -(-seq_len // block_size)
            row = batch.block_tables[i, :num_blocks]
            first = int(row[0])
            if int(row[-1]) - first == num_blocks - 1 and bool((np.diff(row) == 1).all()):
                blocks = slice(first, first + num_blocks)
            else:
                blocks = torch.from_numpy(row.astype(np.int64))
        mask = None
        window_bites = sliding_window is not None and seq_len > sliding_window
        if (q_len > 1 and blocks is not None) or window_bites:
            # new token j sits at position seq_len - q_len + j and sees keys p - window < k <= p
            q_pos = torch.arange(seq_len - q_len, seq_len)
            diff = q_pos[:, None] - torch.arange(seq_len)[None, :]  # (q_len, seq_len)
            mask = diff >= 0
            if sliding_window is not None:
                mask &= diff < sliding_window
        is_causal = mask is None and blocks is None and q_len > 1
        plans.append(_SeqPlan(start, end, seq_len, blocks, mask, is_causal))
    return plans


class PagedAttention:
    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        batch: StepBatch,
        device: torch.device,
        scale: float,
        sliding_window: int | None,
        ops: KernelOps = TORCH_OPS,
        put: Callable[[np.ndarray], torch.Tensor] | None = None,
    ) -> None:
        self.kv_caches, self.scale, self.sliding_window, self.ops = (
            kv_caches,
            scale,
            sliding_window,
            ops,
        )

        if put is None:  # the runner passes its pinned staging; tests may not

            def put(a: np.ndarray) -> torch.Tensor:
                return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

        self.slot_mapping = put(batch.slot_mapping)
        if ops is TORCH_OPS:
            block_size = kv_caches[0][0].shape[1]
            self._plans: list[_SeqPlan] | None = plan_sequences(batch, block_size, sliding_window)
            return
        self._plans = None
        self.max_query_len = int(np.diff(batch.query_start_loc).max())
        self.max_seq_len = int(batch.seq_lens.max())
        self.block_tables = put(batch.block_tables)
        self.seq_lens = put(batch.seq_lens)
        self.query_start_loc = put(batch.query_start_loc)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer_idx]
        self.ops.store_kv(k, v, k_cache, v_cache, self.slot_mapping)
        if self._plans is not None:
            return self._per_sequence(q, k, v, k_cache, v_cache)
        return self.ops.paged_attention(  # host-side maxima spare the kernel a device sync
            q,
            k_cache,
            v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
            sliding_window=self.sliding_window,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
        )

    def _per_sequence(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        assert self._plans is not None
        out = torch.empty_like(q)  # (T, H, D)
        num_kv_heads, head_dim = k_cache.shape[2:]
        is_gqa = q.shape[1] != num_kv_heads
        for p in self._plans:
            if p.blocks is None:
                ks, vs = k[p.start : p.end], v[p.start : p.end]
            elif isinstance(p.blocks, slice):
                ks = k_cache[p.blocks].view(-1, num_kv_heads, head_dim)[: p.seq_len]
                vs = v_cache[p.blocks].view(-1, num_kv_heads, head_dim)[: p.seq_len]
            else:
                ks = k_cache.index_select(0, p.blocks).view(-1, num_kv_heads, head_dim)
                vs = v_cache.index_select(0, p.blocks).view(-1, num_kv_heads, head_dim)
                ks, vs = ks[: p.seq_len], vs[: p.seq_len]
            o = F.scaled_dot_product_attention(  # (H, n, D) over (Hkv, L, D)
                q[p.start : p.end].transpose(0, 1),
                ks.transpose(0, 1),
                vs.transpose(0, 1),
                attn_mask=p.mask,
                is_causal=p.is_causal,
                scale=self.scale,
                enable_gqa=is_gqa,
            )
            out[p.start : p.end] = o.transpose(0, 1)
        return out
