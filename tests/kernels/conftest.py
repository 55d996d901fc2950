"""Backends for the Triton kernel tests, and the per-dtype tolerance they are held to.

A kernel test takes the `backend` fixture: (device, dtype). The CPU cases run the kernels in
triton's interpreter, which must be chosen before triton is first imported (see
`kubeinfer.kernels.jit`), so they run only in a process started with TRITON_INTERPRET=1:
`test_interpreter.py` starts one; elsewhere they are deselected. The CUDA cases run compiled,
in bfloat16, and skip without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from kubeinfer.kernels.jit import has_triton, is_interpreting

BACKENDS = [
    pytest.param(("cpu", torch.float32), id="interp-float32"),
    pytest.param(("cpu", torch.float16), id="interp-float16"),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bfloat16", marks=pytest.mark.gpu),
]

# ||out - ref|| / ||ref|| must stay under this; ref is the torch reference (in float32 where the
# kernel's own rounding is what is measured, see each test).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if is_interpreting():
        return
    # `backend` params only exist on these tests; nothing else is touched
    interpreted = [i for i in items if _backend_device(i) == "cpu"]
    if interpreted:
        config.hook.pytest_deselected(items=interpreted)
        items[:] = [i for i in items if _backend_device(i) != "cpu"]


def _backend_device(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None or "backend" not in callspec.params:
        return None
    return str(callspec.params["backend"][0])


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> tuple[torch.device, torch.dtype]:
    device, dtype = request.param
    if not has_triton():
        pytest.skip("triton is not installed")
    if device == "cpu" and not is_interpreting():  # deselected above; a direct call lands here
        pytest.skip("interpreter cases run in the TRITON_INTERPRET=1 subprocess (test_interpreter)")
    if device == "cuda" and (is_interpreting() or not torch.cuda.is_available()):
        pytest.skip("needs CUDA, and triton in compiled mode")
    return torch.device(device), dtype


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; nan (which fails every bound) if out has any nan."""
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer full of nan: an element the kernel leaves unwritten fails the check."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
