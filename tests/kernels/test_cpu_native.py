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

from kubeinfer.kernels import (
    cpu_native,
    paged_attention_reference,
    rms_norm_reference,
    rotary_embedding_reference,
    silu_and_mul_reference,
    store_kv_reference,
)
from kubeinfer.kernels.checks import KernelInputError


@pytest.fixture(autouse=True)
def _built() -> None:
    """Where a C++ compiler is there (CI, the dev machine) the kernel must build."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the engine uses its pure-torch path")
    assert cpu_native.load(), cpu_native.load_error()


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
@pytest.mark.parametrize(
    "d,heads,hkv,bs",
    [(64, 9, 3, 4), (128, 4, 4, 4), (24, 8, 2, 4), (64, 16, 2, 16), (128, 6, 1, 32)],
)
@pytest.mark.parametrize("window", [None, 7])
def test_matches_reference(
    dtype: torch.dtype, d: int, heads: int, hkv: int, bs: int, window
) -> None:
    """bs 4 puts key runs shorter than the 16-key vector step at every block's edge; 16 and 32
    give whole runs; 16 and 6 query heads per KV head span several register row groups."""
    q, kc, vc, meta = _step(MIXED, dtype, heads=heads, hkv=hkv, d=d, bs=bs)
    want = paged_attention_reference(
        q.float(), kc.float(), vc.float(), *meta, 0.3, sliding_window=window
    )
    out = torch.zeros_like(q)
    ids = torch.arange(len(MIXED), dtype=torch.int32)
    cpu_native.paged_attention_cpu(out, q, kc, vc, *meta, ids, 0.3, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 100])
def test_bfloat16_error_is_the_output_rounding(window) -> None:
    """bfloat16 (the lanes path for prefill chunks, bf16 probabilities; keys in lanes for the
    decodes): the relative L2 error against an exact float32 attention of the same bf16 inputs
    stays within 1.25x of what rounding the exact output to bf16 costs by itself."""
    shape = [(300, 300), (40, 200), (1, 333), (17, 17), (1, 64)]
    q, kc, vc, meta = _step(shape, torch.float32, bs=16, hkv=3, heads=9, d=64, num_blocks=120)
    q, kc, vc = (2 * q).bfloat16(), (2 * kc).bfloat16(), vc.bfloat16()
    want = paged_attention_reference(q.float(), kc.float(), vc.float(), *meta, 0.125, window)
    out = torch.zeros_like(q)
    ids = torch.arange(len(shape), dtype=torch.int32)
    cpu_native.paged_attention_cpu(out, q, kc, vc, *meta, ids, 0.125, window)
    rel = ((out.float() - want).norm() / want.norm()).item()
    rounding = ((want.bfloat16().float() - want).norm() / want.norm()).item()
    assert rel <= 1.25 * rounding, (rel, rounding)


def test_only_the_listed_sequences_are_written_and_q_may_be_strided() -> None:
    q, kc, vc, meta = _step(MIXED, torch.float32)
    wide = torch.randn(q.shape[0], q.shape[1] * 2, q.shape[2])
    wide[:, : q.shape[1]] = q
    strided = wide[:, : q.shape[1]]  # token stride twice the heads'
    assert not strided.is_contiguous()
    want = paged_attention_reference(q, kc, vc, *meta, 0.3)
    out = torch.full_like(q, 7.0)
    ids = torch.tensor([1, 4], dtype=torch.int32)
    cpu_native.paged_attention_cpu(out, strided, kc, vc, *meta, ids, 0.3)
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
        cpu_native.paged_attention_cpu(out, q, kc, vc, bad, lens, qsl, ids, 0.3)
    bad[3, 2] = -1
    with pytest.raises(RuntimeError, match="not a cache block"):
        cpu_native.paged_attention_cpu(out, q, kc, vc, bad, lens, qsl, ids, 0.3)
    with pytest.raises(RuntimeError, match="not a sequence"):
        cpu_native.paged_attention_cpu(
            out, q, kc, vc, table, lens, qsl, torch.tensor([len(MIXED)], dtype=torch.int32), 0.3
        )
    long = lens.clone()
    long[0] = table.shape[1] * kc.shape[1] + 1
    with pytest.raises(RuntimeError, match="more blocks"):
        cpu_native.paged_attention_cpu(out, q, kc, vc, table, long, qsl, ids, 0.3)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_native.paged_attention_cpu(out, q, kc, vc, table.long(), lens, qsl, ids, 0.3)


def test_switched_off_it_is_not_loaded_and_the_engine_keeps_torch() -> None:
    code = (
        "from kubeinfer.kernels import cpu_native as c; import sys; "
        "sys.exit(0 if c.load() is False and c.load_error() is None else 1)"
    )
    env = {"KUBEINFER_CPU_KERNELS": "0", "PATH": "/usr/bin:/bin"}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def test_build_key_changes_with_the_source(tmp_path, monkeypatch) -> None:
    key = cpu_native.build_key()
    src = tmp_path / "k.cpp"
    src.write_text(cpu_native.SOURCES[1].read_text() + "\n// changed\n")
    monkeypatch.setattr(cpu_native, "SOURCES", [cpu_native.SOURCES[0], src])
    assert cpu_native.build_key() != key


# the elementwise kernels: the references' results, with their rounding

ELEMENTWISE_TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 576, generator=g) * 3).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    got = cpu_native.rms_norm_cpu(x, w, 1e-5)
    want = rms_norm_reference(x, w, 1e-5)
    tol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # the fused-residual form: the sum exactly torch's (rounded to the dtype), the norm of it
    r = torch.randn(37, 576, generator=g).to(dtype)
    out, res = cpu_native.rms_norm_cpu(x, w, 1e-5, r)
    want_out, want_res = rms_norm_reference(x, w, 1e-5, r)
    assert torch.equal(res, x + r) and torch.equal(want_res, res)
    torch.testing.assert_close(out, want_out, atol=tol, rtol=tol)
    with pytest.raises(KernelInputError, match="residual"):
        cpu_native.rms_norm_cpu(x, w, 1e-5, r[:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(19, 2 * 1536, generator=g) * 4).to(dtype)
    x[0, :8] = torch.tensor([-100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0, 1e-3]).to(dtype)
    tol = ELEMENTWISE_TOL[dtype]
    got = cpu_native.silu_and_mul_cpu(x)
    torch.testing.assert_close(got, silu_and_mul_reference(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rot_dim", [64, 32])
def test_rotary_matches_reference(dtype: torch.dtype, rot_dim: int) -> None:
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(100, rot_dim, generator=g)
    positions = torch.randint(0, 100, (23,), generator=g)
    q = torch.randn(23, 9, 64, generator=g).to(dtype)
    k = torch.randn(23, 3, 64, generator=g).to(dtype)
    want_q, want_k = rotary_embedding_reference(positions, q.clone(), k.clone(), cache, True)
    got_q, got_k = cpu_native.rotary_embedding_cpu(positions, q, k, cache, True)
    assert got_q.data_ptr() == q.data_ptr()  # in place, as the reference
    tol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k, want_k, atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        cpu_native.rotary_embedding_cpu(torch.tensor([0] * 22 + [100]), q, k, cache, True)


def test_the_engine_uses_them_on_cpu() -> None:
    from kubeinfer.runtime.models.ops import cpu_native_ops

    ops = cpu_native_ops()
    assert ops is not None and ops.name == "torch"
    assert ops.rms_norm is cpu_native.rms_norm_cpu


# store_kv: the step's new keys and values into the cache by slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_matches_reference(dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(7, 5, 8, generator=g).to(dtype)  # a fused projection: k, v are views
    k, v = qkv[:, 1:3], qkv[:, 3:5]
    slots = torch.tensor([5, -1, 0, 63, 17, -1, 40], dtype=slot_dtype)
    want = [torch.randn(4, 16, 2, 8, generator=g).to(dtype) for _ in range(2)]
    got = [c.clone() for c in want]
    store_kv_reference(k.contiguous(), v.contiguous(), *want, slots)
    cpu_native.store_kv_cpu(k, v, *got, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_store_kv_refuses_a_slot_past_the_cache_and_writes_nothing() -> None:
    k = v = torch.ones(3, 2, 8)
    caches = [torch.zeros(4, 16, 2, 8) for _ in range(2)]
    with pytest.raises(KernelInputError, match=r"slot_mapping\[2\] = 64"):
        cpu_native.store_kv_cpu(k, v, *caches, torch.tensor([0, 1, 64]))
    assert not caches[0].any() and not caches[1].any()
    with pytest.raises(KernelInputError, match="dtype"):
        cpu_native.store_kv_cpu(k.double(), v.double(), *caches, torch.tensor([0, 1, 2]))


def test_cpu_flags_are_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine step asks `rows_in_lanes`: /proc/cpuinfo is read on the first ask only."""
    from pathlib import Path

    reads = []
    real = Path.read_text

    def read_text(self: Path, *args, **kwargs) -> str:  # noqa: ANN002, ANN003
        reads.append(str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    cpu_native._cpu_flags.cache_clear()
    first = [cpu_native.rows_in_lanes(torch.bfloat16) for _ in range(3)]
    assert len(set(first)) == 1
    assert reads.count("/proc/cpuinfo") <= 1
