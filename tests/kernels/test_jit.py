"""kernels.jit: the package imports and the references run without triton; launches say why not."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kubeinfer.kernels import KernelInputError, silu_and_mul
from kubeinfer.kernels.jit import has_triton, is_interpreting, next_power_of_2

WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError
import torch
import kubeinfer.kernels as K
assert not K.has_triton()
x = torch.randn(3, 8)
K.rms_norm_reference(x, torch.ones(8), 1e-6)
K.silu_and_mul_reference(x)
try:
    K.silu_and_mul(x)
except K.KernelInputError as e:
    print("refused:", e)
"""


def test_imports_and_references_work_without_triton() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "refused: the Triton kernels need triton, which is not installed" in proc.stdout


def test_cpu_launch_without_the_interpreter_says_what_to_do() -> None:
    if is_interpreting() or not has_triton():
        pytest.skip("needs triton in compiled mode")
    with pytest.raises(KernelInputError, match="x is on cpu: the Triton kernels need CUDA"):
        silu_and_mul(torch.randn(2, 8))


def test_next_power_of_2() -> None:
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 16, 17, 80)] == [1, 1, 2, 4, 16, 32, 128]
