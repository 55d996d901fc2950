"""silu_and_mul (Triton) against silu_and_mul_reference."""

from __future__ import annotations

import pytest
import torch

from kubeinfer.kernels import KernelInputError, silu_and_mul, silu_and_mul_reference
from tests.kernels.conftest import TOLERANCE, poisoned, rel_err


@pytest.mark.parametrize("shape", [(1, 2), (5, 682), (3, 3000), (2, 3, 128)])
def test_silu_and_mul_matches_reference(
    backend: tuple[torch.device, torch.dtype], shape: tuple[int, ...]
) -> None:
    # 3000 = 2 x 1500: a row spans two 1024-wide programs, the second one partly masked
    device, dtype = backend
    x = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(1))).to(device, dtype)
    out = poisoned((*shape[:-1], shape[-1] // 2), dtype, device)
    got = silu_and_mul(x, out=out)
    assert got is out
    assert rel_err(got, silu_and_mul_reference(x)) < TOLERANCE[dtype]


def test_silu_and_mul_rejects_bad_inputs() -> None:
    for fn in (silu_and_mul, silu_and_mul_reference):
        with pytest.raises(KernelInputError, match="x must be"):
            fn(torch.randn(3, 5))
        with pytest.raises(KernelInputError, match="x must be contiguous"):
            fn(torch.randn(8, 3).t())
    with pytest.raises(KernelInputError, match="out must have shape"):
        silu_and_mul(torch.randn(3, 8), out=torch.empty(3, 8))
