"""Runs every `interp-*` kernel case in a fresh process with TRITON_INTERPRET=1.

Triton chooses compiled or interpreted once per process, when it is first imported (see
`kubeinfer.kernels.jit`), and this process may already hold it in compiled mode; a child with
the variable set from the start runs the kernels on CPU tensors in the interpreter. Run
`TRITON_INTERPRET=1 pytest tests/kernels -k interp` to see the cases one by one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kubeinfer.kernels.jit import has_triton, is_interpreting

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.mark.slow
def test_kernels_in_triton_interpreter() -> None:
    if is_interpreting():
        pytest.skip("this process is the interpreter run")
    if not has_triton():
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "interp",
        str(HERE),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    report = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreter run failed ({proc.returncode}):\n{report}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout, report
