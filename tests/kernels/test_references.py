"""The torch references against a naive per-token computation written independently."""

from __future__ import annotations

import math

import pytest
import torch

from kubeinfer.kernels import KernelInputError, paged_attention_reference, store_kv_reference


def make_case(
    q_lens: list[int],
    ctx_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    seed: int = 0,
):  # noqa: ANN201
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens, strict=True)]
    max_blocks = max(math.ceil(n / block_size) for n in seq_lens)
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()  # blocks scattered over the pool
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    for i, n in enumerate(seq_lens):
        for b in range(math.ceil(n / block_size)):
            tables[i, b] = perm.pop()
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl


def naive(q, k_cache, v_cache, tables, seq_lens, qsl, scale, window=None):  # noqa: ANN001, ANN201
    bs = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    for i in range(len(seq_lens)):
        n = int(qsl[i + 1] - qsl[i])
        L = int(seq_lens[i])
        for j in range(n):
            p = L - n + j
            for h in range(q.shape[1]):
                keys = range(max(0, p - window + 1) if window else 0, p + 1)
                ks = torch.stack([k_cache[tables[i, t // bs], t % bs, h // group] for t in keys])
                vs = torch.stack([v_cache[tables[i, t // bs], t % bs, h // group] for t in keys])
                w = torch.softmax(ks @ q[qsl[i] + j, h] * scale, dim=0)
                out[qsl[i] + j, h] = w @ vs
    return out


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 1), (8, 2)])
def test_paged_attention_reference(heads: int, kv_heads: int, window: int | None) -> None:
    # decodes, a first prefill chunk, a later chunk after context, across block boundaries
    q_lens, ctx = [1, 1, 9, 5, 1, 17], [0, 40, 0, 20, 15, 16]
    case = make_case(q_lens, ctx, heads, kv_heads, head_dim=8)
    out = paged_attention_reference(*case, scale=0.3, sliding_window=window)
    ref = naive(*case, scale=0.3, window=window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_store_kv_reference_writes_slots_and_skips_minus_one() -> None:
    k_cache = torch.zeros(4, 16, 2, 8)
    v_cache = torch.zeros(4, 16, 2, 8)
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    slots = torch.tensor([5, -1, 37])
    store_kv_reference(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[0, 5], k[0]) and torch.equal(v_cache[2, 5], v[2])
    assert (k_cache != 0).sum() == (k[0] != 0).sum() + (k[2] != 0).sum()


def test_bad_inputs_name_the_tensor() -> None:
    q, k_cache, v_cache, tables, seq_lens, qsl = make_case([1], [3], 4, 2, 8)
    with pytest.raises(KernelInputError, match="block_tables"):
        paged_attention_reference(q, k_cache, v_cache, tables.long(), seq_lens, qsl, 1.0)
    with pytest.raises(KernelInputError, match="q has 3 heads"):
        paged_attention_reference(q[:, :3], k_cache, v_cache, tables, seq_lens, qsl, 1.0)
    with pytest.raises(KernelInputError, match="k_cache must be contiguous"):
        paged_attention_reference(q, k_cache.transpose(0, 1), v_cache, tables, seq_lens, qsl, 1.0)
