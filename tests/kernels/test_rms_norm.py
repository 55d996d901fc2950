"""rms_norm (Triton) against rms_norm_reference, with and without the fused residual add."""

from __future__ import annotations

import pytest
import torch

from kubeinfer.kernels import KernelInputError, rms_norm, rms_norm_reference
from tests.kernels.conftest import TOLERANCE, poisoned, rel_err


@pytest.mark.parametrize("shape", [(1, 8), (7, 341), (3, 2048), (2, 3, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(
    backend: tuple[torch.device, torch.dtype], shape: tuple[int, ...], with_residual: bool
) -> None:
    device, dtype = backend
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device, dtype)
    residual = torch.randn(shape, generator=g).to(device, dtype) if with_residual else None
    out = poisoned(shape, dtype, device)
    residual_out = poisoned(shape, dtype, device)
    if residual is None:
        got = rms_norm(x, weight, 1e-6, out=out)
        ref = rms_norm_reference(x, weight, 1e-6)
    else:
        got, new_residual = rms_norm(x, weight, 1e-6, residual, out=out, residual_out=residual_out)
        ref, ref_residual = rms_norm_reference(x, weight, 1e-6, residual)
        assert new_residual is residual_out
        assert torch.equal(new_residual, ref_residual)  # one rounding of x + r on both sides
    assert got is out
    assert rel_err(got, ref) < TOLERANCE[dtype]


def test_rms_norm_in_place(backend: tuple[torch.device, torch.dtype]) -> None:
    device, dtype = backend
    x = torch.randn(5, 96).to(device, dtype)
    residual = torch.randn(5, 96).to(device, dtype)
    weight = torch.rand(96).to(device, dtype)
    ref, ref_residual = rms_norm_reference(x, weight, 1e-5, residual)
    rms_norm(x, weight, 1e-5, residual, out=x, residual_out=residual)
    assert rel_err(x, ref) < TOLERANCE[dtype]
    assert torch.equal(residual, ref_residual)


def test_rms_norm_rejects_bad_inputs() -> None:
    x = torch.randn(4, 16)
    for fn in (rms_norm, rms_norm_reference):
        with pytest.raises(KernelInputError, match="weight must have shape"):
            fn(x, torch.ones(8), 1e-6)
        with pytest.raises(KernelInputError, match="weight must be torch.float32"):
            fn(x, torch.ones(16, dtype=torch.float16), 1e-6)
        with pytest.raises(KernelInputError, match="x must be contiguous"):
            fn(x.t(), torch.ones(4), 1e-6)
        with pytest.raises(KernelInputError, match="residual must have shape"):
            fn(x, torch.ones(16), 1e-6, torch.randn(4, 8))
