"""paged_attention (Triton) against paged_attention_reference in float32 on the same inputs.

The batches mix what a step holds: decodes (one new token) and prefill chunks (a first chunk,
a later chunk after cached context), with sequence lengths on both sides of 16-token block
boundaries up to 300, over blocks scattered through the pool (`make_case`).
"""

from __future__ import annotations

import pytest
import torch

from kubeinfer.kernels import KernelInputError, paged_attention, paged_attention_reference
from tests.kernels.conftest import TOLERANCE, poisoned, rel_err
from tests.kernels.test_references import make_case

# (q_len, context_len) per sequence: decodes at seq_len 1, 16, 17, 300; chunks 9 from 0,
# 5 after 20, 33 from 0 (three blocks), 31 after 269 (seq_len 300)
MIXED = [(1, 0), (9, 0), (1, 15), (5, 20), (1, 16), (33, 0), (1, 299), (31, 269)]
DECODES = [(1, 0), (1, 16), (1, 149), (1, 299)]
# heads, kv_heads, head_dim: GQA ratios 1, 4, 8 over both head sizes
HEADS = [(2, 2, 64), (8, 2, 128), (8, 1, 64)]


def run(
    backend: tuple[torch.device, torch.dtype],
    seqs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    **kwargs: object,
) -> float:
    """Relative error of the Triton kernel against the float32 reference on one batch."""
    device, dtype = backend
    q_lens, ctx = [s[0] for s in seqs], [s[1] for s in seqs]
    case = make_case(q_lens, ctx, heads, kv_heads, head_dim, block_size, seed=heads + head_dim)
    q, k_cache, v_cache, tables, seq_lens, qsl = (t.to(device) for t in case)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    scale = head_dim**-0.5
    window = kwargs.get("sliding_window")
    ref = paged_attention_reference(
        q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, qsl, scale, window
    )
    out = poisoned(tuple(q.shape), dtype, device)
    got = paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale, out=out, **kwargs)
    assert got is out
    return rel_err(got, ref)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEADS)
def test_mixed_prefill_and_decode(
    backend: tuple[torch.device, torch.dtype], heads: int, kv_heads: int, head_dim: int
) -> None:
    assert run(backend, MIXED, heads, kv_heads, head_dim) < TOLERANCE[backend[1]]


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEADS)
def test_decode_batch_split_kv(
    backend: tuple[torch.device, torch.dtype],
    heads: int,
    kv_heads: int,
    head_dim: int,
    num_splits: int,
) -> None:
    # 5 splits of a 1-token sequence: four of them see no key and must weigh nothing
    err = run(backend, DECODES, heads, kv_heads, head_dim, num_splits=num_splits, max_query_len=1)
    assert err < TOLERANCE[backend[1]]


def test_split_kv_on_prefill_chunks(backend: tuple[torch.device, torch.dtype]) -> None:
    # a split's keys can all lie past an early row of a chunk (causal): that row gets lse -inf
    seqs = [(1, 40), (20, 60), (7, 0)]
    assert run(backend, seqs, 8, 2, 64, num_splits=3) < TOLERANCE[backend[1]]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sliding_window(backend: tuple[torch.device, torch.dtype], num_splits: int) -> None:
    seqs = [(1, 0), (1, 299), (9, 0), (33, 40), (1, 70)]
    err = run(backend, seqs, 8, 2, 64, sliding_window=20, num_splits=num_splits)
    assert err < TOLERANCE[backend[1]]


def test_odd_shapes(backend: tuple[torch.device, torch.dtype]) -> None:
    # GQA ratio 3 (not a power of two), head_dim 80 (padded to 128), blocks of 8
    seqs = [(1, 30), (12, 5), (1, 0)]
    assert run(backend, seqs, 6, 2, 80, block_size=8) < TOLERANCE[backend[1]]


def test_q_may_be_a_view_into_qkv(backend: tuple[torch.device, torch.dtype]) -> None:
    device, dtype = backend
    q, k_cache, v_cache, tables, seq_lens, qsl = (
        t.to(device) for t in make_case([3, 1], [14, 20], 4, 2, 64)
    )
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    qkv = torch.cat([q.flatten(1), torch.randn(4, 256, device=device, dtype=dtype)], dim=1)
    q_view = qkv[:, :256].view(4, 4, 64)
    assert not q_view.is_contiguous()
    got = paged_attention(q_view, k_cache, v_cache, tables, seq_lens, qsl, 0.125)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, qsl, 0.125)
    assert rel_err(got, ref) < TOLERANCE[dtype]


def test_paged_attention_rejects_bad_inputs() -> None:
    q, k_cache, v_cache, tables, seq_lens, qsl = make_case([1], [3], 4, 2, 8)
    with pytest.raises(KernelInputError, match="seq_lens must be torch.int32"):
        paged_attention(q, k_cache, v_cache, tables, seq_lens.long(), qsl, 1.0)
    with pytest.raises(KernelInputError, match="num_splits"):
        paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 1.0, num_splits=0)
    with pytest.raises(KernelInputError, match="sliding_window"):
        paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 1.0, sliding_window=0)
    with pytest.raises(KernelInputError, match="out must have shape"):
        paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 1.0, out=q[:, :2])


def test_split_kv_is_chosen_for_small_decode_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from kubeinfer.kernels.paged_attention import _auto_num_splits

    props = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    q = SimpleNamespace(device=torch.device("cuda", 0))
    lens = torch.tensor([8192] * 4, dtype=torch.int32)

    def splits(programs: int, max_q: int, max_len: int | None, window: int | None = None) -> int:
        return _auto_num_splits(q, lens, programs, max_q, max_len, window)  # type: ignore[arg-type]

    assert splits(4 * 8, 1, 8192) == 9  # ceil(2 * 132 / 32): two programs per SM
    assert splits(4 * 8, 1, None) == 9  # max_seq_len read from seq_lens
    assert splits(64 * 8, 1, 2048) == 1  # enough programs already
    assert splits(4 * 8, 7, 8192) == 1  # a prefill chunk in the step
    assert splits(4 * 8, 1, 300) == 1  # too few keys to share
    assert splits(4 * 8, 1, 8192, window=512) == 2  # the window bounds the keys
    assert splits(1, 1, 1 << 20) == 32  # capped at MAX_SPLITS
