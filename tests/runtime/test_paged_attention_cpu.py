"""The engine's CPU attention (SDPA over each sequence's own keys, decodes in groups) matches
`paged_attention_reference` on mixed steps: fresh prefills, decodes, chunks with context,
scattered and consecutive blocks, grouped-query heads, a sliding window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kubeinfer.kernels import paged_attention_reference
from kubeinfer.runtime.engine.attention import PagedAttention
from kubeinfer.runtime.engine.batch import StepBatch


def _check_against_reference(
    shape: list[tuple[int, int]],
    sliding_window: int | None,
    num_blocks: int = 40,
    fresh_rows: list[tuple[int, int]] | None = None,
) -> None:
    fresh_rows = [] if fresh_rows is None else fresh_rows
    g = torch.Generator().manual_seed(0)
    bs, hkv, heads, d = 4, 2, 6, 8
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, used = [], [], 0
    for i, (_, seq_len) in enumerate(shape):
        n = -(-seq_len // bs)
        row = list(range(num_blocks - n, num_blocks)) if i == 2 else perm[used : used + n]
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
    if attn._native is not None:  # which fresh prefills went to SDPA beside the C++ kernel
        fresh_rows.extend((start, end) for start, end, _ in attn._native.fresh)
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


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_per_sequence_cpu_path_matches_reference(sliding_window: int | None) -> None:
    # (q_len, seq_len): fresh prefill, decode, chunk with context (consecutive blocks),
    # 1-token fresh, long decode
    _check_against_reference([(7, 7), (1, 9), (5, 13), (1, 1), (1, 22)], sliding_window)


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_long_fresh_prefills_take_sdpa_beside_the_kernel(
    sliding_window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kubeinfer.kernels import cpu_native
    from kubeinfer.runtime.engine import attention

    monkeypatch.setattr(attention, "FRESH_SDPA_OVER", 6)  # (float32 here)
    fresh: list[tuple[int, int]] = []
    # fresh 7 and 9 (over 6: SDPA), fresh 6 and 1 (the kernel), a decode, a chunk with context
    shape = [(7, 7), (1, 9), (6, 6), (5, 13), (1, 1), (9, 9)]
    _check_against_reference(shape, sliding_window, num_blocks=60, fresh_rows=fresh)
    if cpu_native.load():
        assert fresh == [(0, 7), (20, 29)]


def test_fresh_prefills_go_through_the_kernel_where_it_has_its_lanes_path() -> None:
    from kubeinfer.kernels import cpu_native
    from kubeinfer.runtime.engine.attention import FRESH_SDPA_OVER, fresh_sdpa_over

    for dtype in (torch.float32, torch.bfloat16):
        assert fresh_sdpa_over(dtype, 80) == FRESH_SDPA_OVER  # no lanes path for 80
        want = None if cpu_native.rows_in_lanes(dtype) else FRESH_SDPA_OVER
        assert fresh_sdpa_over(dtype, 64) == fresh_sdpa_over(dtype, 128) == want
    assert fresh_sdpa_over(torch.float16, 64) == FRESH_SDPA_OVER


@pytest.mark.parametrize("sliding_window", [None, 12])
def test_grouped_decodes_match_reference(sliding_window: int | None) -> None:
    # 19 decodes of mixed lengths (more than two groups, unsorted, one of a single block)
    # between a fresh prefill and a chunk: each group pads to its longest and masks the rest
    rng = np.random.default_rng(1)
    decodes = [(1, int(n)) for n in rng.integers(2, 30, size=18)] + [(1, 3)]
    shape = [(6, 6), (4, 10), *decodes]
    _check_against_reference(shape, sliding_window, num_blocks=200)


def test_decode_groups_sorted_by_length_and_capped() -> None:
    from kubeinfer.runtime.engine.attention import DECODE_GROUP, plan_decode_groups

    lens = [40, 3, 17, 9, 2, 33, 25, 11, 5, 29, 8]
    bs = 4
    width = -(-max(lens) // bs)
    table = np.arange(len(lens) * width, dtype=np.int32).reshape(len(lens), width)
    batch = StepBatch(
        np.zeros(len(lens), dtype=np.int64),
        np.zeros(len(lens), dtype=np.int64),
        np.zeros(len(lens), dtype=np.int64),
        table,
        np.array(lens, dtype=np.int32),
        np.arange(len(lens) + 1, dtype=np.int32),
        [],
        [],
    )
    groups, covered = plan_decode_groups(batch, bs, None)
    assert covered == set(range(len(lens)))
    assert [g.rows.numel() for g in groups] == [DECODE_GROUP, len(lens) - DECODE_GROUP]
    order = [lens[int(r)] for g in groups for r in g.rows]
    assert order == sorted(lens)
    assert groups[0].num_blocks == -(-sorted(lens)[DECODE_GROUP - 1] // bs)
    # a lone decode, or none, is left to the per-sequence path
    one = StepBatch(
        *(
            getattr(batch, f)[:1]
            for f in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens")
        ),
        np.arange(2, dtype=np.int32),
        [],
        [],
    )
    assert plan_decode_groups(one, bs, None) == ([], set())
