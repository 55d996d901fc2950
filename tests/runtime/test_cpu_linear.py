"""oneDNN-prepacked linears: row buckets (bounded primitive shapes) and padded results."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kubeinfer.runtime.models import cpu_linear
from kubeinfer.runtime.models.cpu_linear import (
    PackedLinear,
    bucket_rows,
    can_pack,
    cpu_vendor,
    pack_dtype,
    pack_linears,
)


def test_buckets_bound_the_shapes_and_the_padding() -> None:
    buckets = {bucket_rows(m) for m in range(1, 2049)}
    assert len(buckets) == 68  # was one shape per row count: 2048
    for m in range(1, 4097):
        b = bucket_rows(m)
        assert b >= m and bucket_rows(b) == b
        assert (b - m) / m < 0.18, m
    assert [bucket_rows(m) for m in (1, 16, 17, 64, 65, 257, 1025)] == [
        1, 16, 20, 64, 72, 288, 1152,
    ]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 100, 128, 300])
@pytest.mark.parametrize("lead", [(), (2,)])
def test_padded_rows_give_the_unpadded_result(
    dtype: torch.dtype, rows: int, lead: tuple[int, ...]
) -> None:
    """2-D inputs of a bucket's row count take the direct call; others are padded."""
    if (compute := pack_dtype(dtype)) is None:
        pytest.skip(f"oneDNN packing is not available here for {dtype}")
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True).to(dtype)
    x = torch.randn(*lead, rows, 64).to(dtype)
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    got = PackedLinear(linear, compute=compute)(x)
    assert got.shape == (*lead, rows, 48) and got.is_contiguous()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_cpu_vendor_reads_cpuinfo() -> None:
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
    assert cpu_vendor(text) == "AuthenticAMD"
    assert cpu_vendor("processor\t: 0\n") == ""


@pytest.mark.parametrize("intel", [True, False])
def test_float32_keeps_plain_weights_for_mkl_on_intel_only(
    intel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MKL serves 1-2 rows faster than oneDNN on Intel CPUs; on AMD its generic path is 1-3x
    slower (the LM head at one row: 10.0 vs 3.4 ms), so the plain weights are not kept there."""
    if not can_pack(torch.float32):
        pytest.skip("oneDNN packing is not available here for float32")
    monkeypatch.setattr(cpu_linear, "mkl_few_rows", lambda: intel)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 8))
    x = torch.randn(1, 64)
    want = model(x)
    assert pack_linears(model) == 2
    assert all((layer.plain is not None) == intel for layer in model)
    torch.testing.assert_close(model(x), want, atol=1e-4, rtol=1e-4)


def test_half_precision_packs_in_float32_where_onednn_has_no_kernel_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU without AVX512-BW/VL/DQ or AVX-NE-CONVERT oneDNN refuses to pack bfloat16, and
    the model's linears stayed plain bfloat16 `aten::mm` (82 % of a step; 24.7 output tokens/s
    against float32's 104.8 on the AVX2-only dev machine). They now pack in float32: bfloat16
    in and out, float32 arithmetic, as a bfloat16 GEMM with float32 accumulation computes."""
    if not can_pack(torch.float32):
        pytest.skip("oneDNN packing is not available here for float32")
    monkeypatch.setitem(cpu_linear._CHECKED, torch.bfloat16, False)  # as on an AVX2-only CPU
    monkeypatch.setitem(cpu_linear._CHECKED, torch.float16, False)
    assert pack_dtype(torch.bfloat16) == pack_dtype(torch.float16) == torch.float32
    assert pack_dtype(torch.float32) == torch.float32
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40, bias=False)).to(torch.bfloat16)
    for rows in (1, 5, 17, 300):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        h = torch.nn.functional.linear(x.float(), model[0].weight.float(), model[0].bias.float())
        want = torch.nn.functional.linear(h.bfloat16().float(), model[1].weight.float())
        if rows == 1:
            packed = nn.Sequential(*model)
            assert pack_linears(packed) == 2
        got = packed(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 40)
        assert all(layer.packed.dtype == torch.float32 for layer in packed)
        assert all(layer.weight.dtype == torch.bfloat16 for layer in packed)  # as the model's
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_nothing_packs_where_onednn_packs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        monkeypatch.setitem(cpu_linear._CHECKED, dtype, False)
    assert pack_dtype(torch.bfloat16) is None and pack_dtype(torch.float32) is None
