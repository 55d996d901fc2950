"""PagedAttention: the engine's attention backend for one step, over the paged KV cache.

Every layer stores the step's new k/v by slot, then attends. With the Triton kernels the whole
step is one varlen launch. With the torch references there is a CPU shortcut: a sequence whose
new tokens are all of it (a first prefill chunk, no cached context) attends over its own new
k/v with plain causal SDPA, skipping the gather from the cache; everything else (decodes,
later chunks, prefix-cache hits) goes through `paged_attention_reference`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kubeinfer.runtime.engine.batch import StepBatch
from kubeinfer.runtime.models import CausalAttention
from kubeinfer.runtime.models.ops import TORCH_OPS, KernelOps


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
        q_lens = np.diff(batch.query_start_loc)
        self.max_query_len = int(q_lens.max())
        self.max_seq_len = int(batch.seq_lens.max())
        fresh = (q_lens == batch.seq_lens) & (q_lens > 1) if ops is TORCH_OPS else q_lens < 0
        self._fresh: CausalAttention | None = None
        self._fresh_rows = self._other_rows = None
        if fresh.any():
            starts = batch.query_start_loc
            rows = [np.arange(starts[i], starts[i + 1]) for i in range(len(q_lens))]
            fresh_rows = np.concatenate([rows[i] for i in np.flatnonzero(fresh)])
            self._fresh = CausalAttention.for_lengths(q_lens[fresh].tolist(), scale, sliding_window)
            if not fresh.all():
                self._fresh_rows = put(fresh_rows)
                self._other_rows = put(np.concatenate([rows[i] for i in np.flatnonzero(~fresh)]))
        others = ~fresh
        self.block_tables = put(np.ascontiguousarray(batch.block_tables[others]))
        self.seq_lens = put(batch.seq_lens[others])
        self.query_start_loc = put(
            np.concatenate([[0], np.cumsum(q_lens[others])]).astype(np.int32)
        )
        self._has_others = bool(others.any())

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer_idx]
        self.ops.store_kv(k, v, k_cache, v_cache, self.slot_mapping)
        if self._fresh is None:
            return self._paged(q, k_cache, v_cache)
        if self._fresh_rows is None:  # every sequence is a fresh prefill
            return self._fresh.forward(layer_idx, q, k, v)
        out = torch.empty_like(q)
        rows = self._fresh_rows
        out[rows] = self._fresh.forward(layer_idx, q[rows], k[rows], v[rows])
        out[self._other_rows] = self._paged(q[self._other_rows], k_cache, v_cache)
        return out

    def _paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        if self.ops is TORCH_OPS:
            return self.ops.paged_attention(
                q,
                k_cache,
                v_cache,
                self.block_tables,
                self.seq_lens,
                self.query_start_loc,
                self.scale,
                sliding_window=self.sliding_window,
            )
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
