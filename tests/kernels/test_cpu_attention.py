"""The C++ CPU paged-attention kernel (kernels/cpu) against `paged_attention_reference`: mixed
steps (decodes, chunks with context, long chunks over several query chunks), every dtype, head
dims with and without a compiled specialisation, grouped-query heads, a sliding window; and the
checks that keep a bad block table or sequence id from reading outside the cache."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from kubeinfer.kernels import cpu_attention, paged_attention_reference


@pytest.fixture(autouse=True)
def _built() -> None:
    """Where a C++ compiler is there (CI, the dev machine) the kernel must build."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the engine uses its pure-torch path")
    assert cpu_attention.load(), cpu_attention.load_error()


def _step(shape, dtype, *, bs=4, hkv=2, heads=6, d=8, num_blocks=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for _, seq_len in shape:
        n = -(-seq_len // bs)
        tables.append(perm[used : used + n])
        used += n
    table = np.full((len(shape), max(map(len, tables)) + 1), -1, dtype=np.int32)
    for i, row in enumerate(tables):
        table[i, : len(row)] = row
    qsl = np.concatenate([[0], np.cumsum([q for q, _ in shape])]).astype(np.int32)
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    q = torch.randn(int(qsl[-1]), heads, d, generator=g).to(dtype)
    meta = (
        torch.from_numpy(table),
        torch.tensor([s for _, s in shape], dtype=torch.int32),
        torch.from_numpy(qsl),
    )
    return q, k_cache, v_cache, meta


MIXED = [(1, 9), (5, 13), (1, 1), (1, 22), (37, 60), (20, 20), (1, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,heads,hkv", [(64, 9, 3), (128, 4, 4), (24, 8, 2)])
@pytest.mark.parametrize("window", [None, 7])
def test_matches_reference(dtype: torch.dtype, d: int, heads: int, hkv: int, window) -> None:
    q, kc, vc, meta = _step(MIXED, dtype, heads=heads, hkv=hkv, d=d)
    want = paged_attention_reference(
        q.float(), kc.float(), vc.float(), *meta, 0.3, sliding_window=window
    )
    out = torch.zeros_like(q)
    ids = torch.arange(len(MIXED), dtype=torch.int32)
    cpu_attention.paged_attention_cpu(out, q, kc, vc, *meta, ids, 0.3, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def test_only_the_listed_sequences_are_written_and_q_may_be_strided() -> None:
    q, kc, vc, meta = _step(MIXED, torch.float32)
    wide = torch.randn(q.shape[0], q.shape[1] * 2, q.shape[2])
    wide[:, : q.shape[1]] = q
    strided = wide[:, : q.shape[1]]  # token stride twice the heads'
    assert not strided.is_contiguous()
    want = paged_attention_reference(q, kc, vc, *meta, 0.3)
    out = torch.full_like(q, 7.0)
    ids = torch.tensor([1, 4], dtype=torch.int32)
    cpu_attention.paged_attention_cpu(out, strided, kc, vc, *meta, ids, 0.3)
    qsl = meta[2].tolist()
    written = torch.zeros(q.shape[0], dtype=torch.bool)
    for i in (1, 4):
        written[qsl[i] : qsl[i + 1]] = True
    torch.testing.assert_close(out[written], want[written], atol=1e-5, rtol=1e-5)
    assert bool((out[~written] == 7.0).all())


def test_a_bad_block_id_or_sequence_id_is_an_error_not_a_read() -> None:
    q, kc, vc, (table, lens, qsl) = _step(MIXED, torch.float32)
    out = torch.empty_like(q)
    ids = torch.arange(len(MIXED), dtype=torch.int32)
    bad = table.clone()
    bad[3, 2] = kc.shape[0]  # one past the cache
    with pytest.raises(RuntimeError, match=r"block_tables\[3, 2\]"):
        cpu_attention.paged_attention_cpu(out, q, kc, vc, bad, lens, qsl, ids, 0.3)
    bad[3, 2] = -1
    with pytest.raises(RuntimeError, match="not a cache block"):
        cpu_attention.paged_attention_cpu(out, q, kc, vc, bad, lens, qsl, ids, 0.3)
    with pytest.raises(RuntimeError, match="not a sequence"):
        cpu_attention.paged_attention_cpu(
            out, q, kc, vc, table, lens, qsl, torch.tensor([len(MIXED)], dtype=torch.int32), 0.3
        )
    long = lens.clone()
    long[0] = table.shape[1] * kc.shape[1] + 1
    with pytest.raises(RuntimeError, match="more blocks"):
        cpu_attention.paged_attention_cpu(out, q, kc, vc, table, long, qsl, ids, 0.3)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_attention.paged_attention_cpu(out, q, kc, vc, table.long(), lens, qsl, ids, 0.3)


def test_switched_off_it_is_not_loaded_and_the_engine_keeps_torch() -> None:
    code = (
        "from kubeinfer.kernels import cpu_attention as c; import sys; "
        "sys.exit(0 if c.load() is False and c.load_error() is None else 1)"
    )
    env = {"KUBEINFER_CPU_KERNELS": "0", "PATH": "/usr/bin:/bin"}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def test_build_key_changes_with_the_source(tmp_path, monkeypatch) -> None:
    key = cpu_attention.build_key()
    src = tmp_path / "k.cpp"
    src.write_text(cpu_attention.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(cpu_attention, "SOURCE", src)
    assert cpu_attention.build_key() != key
