"""The engine's CPU attention (one SDPA per sequence over exactly its keys) matches
`paged_attention_reference` on mixed steps: fresh prefills, decodes, chunks with context,
scattered and consecutive blocks, grouped-query heads, a sliding window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kubeinfer.kernels import paged_attention_reference
from kubeinfer.runtime.engine.attention import PagedAttention
from kubeinfer.runtime.engine.batch import StepBatch


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_per_sequence_cpu_path_matches_reference(sliding_window: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    bs, hkv, heads, d, num_blocks = 4, 2, 6, 8, 40
    # (q_len, seq_len): fresh prefill, decode, chunk with context, 1-token fresh, long decode
    shape = [(7, 7), (1, 9), (5, 13), (1, 1), (1, 22)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, used = [], [], 0
    for i, (_, seq_len) in enumerate(shape):
        n = -(-seq_len // bs)
        row = list(range(30, 30 + n)) if i == 2 else perm[used : used + n]  # i=2: consecutive
        used += n
        tables.append(row)
    width = max(map(len, tables))
    table = np.full((len(shape), width), -1, dtype=np.int32)
    for i, row in enumerate(tables):
        table[i, : len(row)] = row
    for (q_len, seq_len), row in zip(shape, tables, strict=True):
        slots += [row[p // bs] * bs + p % bs for p in range(seq_len - q_len, seq_len)]
    q_lens = [q for q, _ in shape]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(qsl[-1])
    batch = StepBatch(
        np.zeros(num_tokens, dtype=np.int64),
        np.zeros(num_tokens, dtype=np.int64),
        np.array(slots, dtype=np.int64),
        table,
        np.array([s for _, s in shape], dtype=np.int32),
        qsl,
        [],
        [],
    )
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    q = torch.randn(num_tokens, heads, d, generator=g)
    k = torch.randn(num_tokens, hkv, d, generator=g)
    v = torch.randn(num_tokens, hkv, d, generator=g)
    attn = PagedAttention([(k_cache, v_cache)], batch, torch.device("cpu"), 0.3, sliding_window)
    got = attn.forward(0, q, k, v)  # stores k/v first, as the reference expects them stored
    want = paged_attention_reference(
        q,
        k_cache,
        v_cache,
        torch.from_numpy(table),
        torch.from_numpy(batch.seq_lens),
        torch.from_numpy(qsl),
        0.3,
        sliding_window=sliding_window,
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
