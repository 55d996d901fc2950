"""PagedAttention: the engine's attention backend for one step, over the paged KV cache.

Every layer stores the step's new k/v by slot, then attends. With the Triton kernels the whole
step is one varlen launch. On CPU, where the C++ kernel builds (kernels/cpu_native.py), every
sequence that reads the cache (decodes, later chunks, prefix hits) and every fresh prefill of up
to `fresh_sdpa_over` tokens (all of them with AVX-512, head dims 64 and 128) goes through it in
one call per layer, reading keys in place through the block table; longer fresh prefills use
causal SDPA over their own k/v (`_NativePlan`). Without it (no compiler, or
KUBEINFER_CPU_KERNELS=0) the step is planned once, shared by every layer, as SDPA calls over
each sequence's own keys (decodes in groups):

- a sequence whose new tokens are all of it (a first prefill chunk, no cached context) attends
  over its own new k/v with causal SDPA, never reading the cache;
- decodes (one new token over cached keys) go in groups of up to `DECODE_GROUP` sequences of
  similar length (sorted by length, so padding stays small): one `index_select` of the group's
  blocks into a scratch buffer reused by every layer, then one masked SDPA for the group. A
  decode's attention is a few hundred kFLOP, so one call per decode is mostly per-call cost
  (at 64 decodes: 7.2 -> 4.0 ms per layer on 2 cores);
- any other (a later chunk, a prefix-cache hit) reads its blocks from the cache: a view when
  its blocks are consecutive, else one `index_select` of whole blocks, cut to its length.

A padded batch of the whole step (every sequence gathered to the longest, then one masked
SDPA, as `paged_attention_reference` does) costs several times more on CPU: the copy is a fresh
allocation of S * max_len rows per layer, paid in page faults and memory traffic, and the
padding is computed and thrown away. Decode groups pad only among similar lengths, into one
buffer reused by every layer. Both compute softmax(q k^T * scale + mask) v over the same
keys; tests/runtime/test_paged_attention_cpu.py checks this path against the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kubeinfer.kernels import cpu_native
from kubeinfer.runtime.engine.batch import StepBatch
from kubeinfer.runtime.models.attention import causal_sdpa, window_mask
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


DECODE_GROUP = 8
"""Most decodes attended in one SDPA call on CPU (4-16 measure alike on 2 cores)."""

FRESH_SDPA_OVER = 512
"""Fresh prefills (nothing cached before them) longer than this go to SDPA beside the C++ kernel
where it has no lanes path for them (`cpu_native.rows_in_lanes`: float32 with AVX-512, bfloat16
with AVX512_BF16, head dims 64 and 128); shorter ones go through the kernel with the rest of the
step. Measured on the dev machine (AMD EPYC, 2 threads, 9 query / 3 KV heads of 64), float32
without the lanes path: the kernel takes 0.6x SDPA's time at 64-264 tokens (84 vs 131 us at 64,
889 vs 1475 us at 264), 0.8x at 512, and SDPA wins from 768. With the lanes path the kernel
takes every fresh prefill: float32 0.4-0.8x SDPA's time from 64 to 2048 tokens (61 vs 143 us at
64, 586 vs 1635 us at 264, 32 vs 41 ms at 2048), bfloat16 0.25-0.55x. On the AVX2-only dev
machine (its `run_avx2` path) float32 0.5-0.65x SDPA's time up to 512 tokens (104 vs 219 us at
64, 3.2 vs 5.1 ms at 512), even at 1024 and 1.25x at 2048: the limit holds there too."""


def fresh_sdpa_over(dtype: torch.dtype, head_dim: int) -> int | None:
    """Fresh prefills longer than this attend by SDPA on CPU; None: none do."""
    if head_dim in (64, 128) and cpu_native.rows_in_lanes(dtype):
        return None
    return FRESH_SDPA_OVER


@dataclass(slots=True)
class _DecodeGroup:
    """Decodes attended together: one query each, keys padded to the longest and masked."""

    rows: torch.Tensor
    """(n,) their token rows in the flat batch."""
    blocks: torch.Tensor
    """(n * num_blocks,) their cache blocks, each row padded with block 0 (masked out)."""
    num_blocks: int
    mask: torch.Tensor
    """(n, 1, 1, num_blocks * block_size) True on each row's real keys."""


def plan_decode_groups(
    batch: StepBatch, block_size: int, sliding_window: int | None, group: int = DECODE_GROUP
) -> tuple[list[_DecodeGroup], set[int]]:
    """Group the step's plain decodes by length; also the sequence indices they cover."""
    qsl = batch.query_start_loc
    seq_lens = batch.seq_lens
    q_lens = qsl[1:] - qsl[:-1]
    ok = (q_lens == 1) & (seq_lens > 1)
    if sliding_window is not None:
        ok &= seq_lens <= sliding_window
    idx = np.flatnonzero(ok)
    if len(idx) < 2:  # nothing to share: the per-sequence path is as good
        return [], set()
    idx = idx[np.argsort(seq_lens[idx], kind="stable")]
    groups = []
    for g in range(0, len(idx), group):
        members = idx[g : g + group]
        lens = seq_lens[members].astype(np.int64)
        num_blocks = int(-(-lens.max() // block_size))
        table = np.maximum(batch.block_tables[members, :num_blocks], 0).astype(np.int64)
        mask = np.arange(num_blocks * block_size)[None, :] < lens[:, None]
        groups.append(
            _DecodeGroup(
                torch.from_numpy(qsl[members].astype(np.int64)),
                torch.from_numpy(table.reshape(-1)),
                num_blocks,
                torch.from_numpy(mask)[:, None, None, :],
            )
        )
    return groups, set(idx.tolist())


def plan_sequences(
    batch: StepBatch, block_size: int, sliding_window: int | None, skip: set[int] | None = None
) -> list[_SeqPlan]:
    """Per-sequence SDPA arguments for the step, computed once and shared by every layer
    (the sequences in `skip` are attended elsewhere)."""
    starts = batch.query_start_loc.tolist()
    seq_lens = batch.seq_lens.tolist()
    plans = []
    for i, seq_len in enumerate(seq_lens):
        if skip and i in skip:
            continue
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


@dataclass(slots=True)
class _NativePlan:
    """A CPU step through the C++ kernel (kernels/cpu): every sequence that reads the cache
    (decodes, later chunks, prefix hits) and every short fresh prefill in one call; fresh
    prefills (all of the sequence is new) of more than `fresh_sdpa_over` tokens by causal SDPA
    over their own k/v, which is faster for a long block with nothing cached."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    seq_ids: torch.Tensor
    fresh: list[tuple[int, int, torch.Tensor | None]]
    """(start, end) rows of the long fresh prefills, and each one's window mask (None: causal)."""

    @classmethod
    def build(
        cls, batch: StepBatch, sliding_window: int | None, sdpa_over: int | None
    ) -> _NativePlan:
        qsl = batch.query_start_loc
        q_lens = qsl[1:] - qsl[:-1]
        fresh = q_lens == batch.seq_lens
        fresh &= q_lens > sdpa_over if sdpa_over is not None else False
        starts, ends = qsl[:-1][fresh].tolist(), qsl[1:][fresh].tolist()
        masks = [window_mask(e - s, sliding_window) for s, e in zip(starts, ends, strict=True)]
        return cls(
            torch.from_numpy(np.ascontiguousarray(batch.block_tables, dtype=np.int32)),
            torch.from_numpy(np.ascontiguousarray(batch.seq_lens, dtype=np.int32)),
            torch.from_numpy(np.ascontiguousarray(qsl, dtype=np.int32)),
            torch.from_numpy(np.flatnonzero(~fresh).astype(np.int32)),
            list(zip(starts, ends, masks, strict=True)),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        if self.seq_ids.numel():
            cpu_native.paged_attention_cpu(
                out,
                q,
                k_cache,
                v_cache,
                self.block_tables,
                self.seq_lens,
                self.query_start_loc,
                self.seq_ids,
                scale,
                sliding_window,
            )
        for start, end, mask in self.fresh:
            out[start:end] = causal_sdpa(q[start:end], k[start:end], v[start:end], scale, mask)
        return out


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
        self._native: _NativePlan | None = None
        if ops.name == "torch" and device.type == "cpu" and cpu_native.load():
            k_cache = kv_caches[0][0]
            over = fresh_sdpa_over(k_cache.dtype, k_cache.shape[-1])
            self._native = _NativePlan.build(batch, sliding_window, over)
            self._plans = None
            return
        if ops.name == "torch":
            k_cache = kv_caches[0][0]
            block_size = k_cache.shape[1]
            self._groups, grouped = plan_decode_groups(batch, block_size, sliding_window)
            self._plans: list[_SeqPlan] | None = plan_sequences(
                batch, block_size, sliding_window, grouped
            )
            most = max((g.blocks.numel() for g in self._groups), default=0)
            # one scratch pair for every layer's gathers (no fresh allocation per layer)
            self._scratch = [k_cache.new_empty((most, *k_cache.shape[1:])) for _ in range(2)]
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
        if self._native is not None:
            return self._native.forward(q, k, v, k_cache, v_cache, self.scale, self.sliding_window)
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
        sk, sv = self._scratch
        for g in self._groups:
            n, m = g.rows.numel(), g.blocks.numel()
            ks = torch.index_select(k_cache, 0, g.blocks, out=sk[:m]).view(n, -1, *sk.shape[2:])
            vs = torch.index_select(v_cache, 0, g.blocks, out=sv[:m]).view(n, -1, *sv.shape[2:])
            o = F.scaled_dot_product_attention(  # (n, H, 1, D) over (n, Hkv, L, D)
                q.index_select(0, g.rows)[:, :, None, :],
                ks.transpose(1, 2),
                vs.transpose(1, 2),
                attn_mask=g.mask,
                scale=self.scale,
                enable_gqa=is_gqa,
            )
            out.index_copy_(0, g.rows, o[:, :, 0, :])
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
