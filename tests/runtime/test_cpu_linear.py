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
    if not can_pack(dtype):
        pytest.skip(f"oneDNN packing is not available here for {dtype}")
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True).to(dtype)
    x = torch.randn(*lead, rows, 64).to(dtype)
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    got = PackedLinear(linear)(x)
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
