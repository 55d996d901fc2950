"""The model through the Triton kernels (in triton's interpreter, on CPU) gives the torch
backend's greedy tokens; `kernels=` picks the backend and refuses what cannot run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kubeinfer.kernels import has_triton
from kubeinfer.runtime.models.ops import TORCH_OPS, select_kernels

CHILD = r"""
import json, sys
from kubeinfer.runtime import LLM, SamplingParams
model_dir = sys.argv[1]
prompts = [[5, 17, 99, 3], [250, 7], list(range(20, 57))]
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
out = {}
for kernels in ("torch", "triton"):
    llm = LLM(model_dir, dtype="float32", kernels=kernels, num_kv_blocks=32,
              max_num_batched_tokens=24)  # chunked: prefill chunks mix with decodes
    assert llm.engine.runner.ops.name == kernels
    out[kernels] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
print(json.dumps(out))
"""


@pytest.mark.skipif(not has_triton(), reason="triton is not installed")
@pytest.mark.timeout(600)
def test_triton_backend_in_interpreter_matches_torch(tiny_models: dict[str, Path]) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_models["llama-gqa"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["triton"] == out["torch"]
    assert all(len(t) == 6 for t in out["torch"])


def test_auto_is_torch_on_cpu_and_triton_is_refused_without_cuda() -> None:
    assert select_kernels("auto", torch.device("cpu")) is TORCH_OPS
    assert select_kernels("torch", torch.device("cpu")) is TORCH_OPS
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="CUDA"):
            select_kernels("triton", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_backend_on_gpu_bfloat16(tiny_models: dict[str, Path]) -> None:
    from kubeinfer.runtime import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 17, 99, 3], list(range(20, 90))]
    outs = {}
    for kernels in ("torch", "triton"):
        llm = LLM(
            tiny_models["llama-gqa"],
            dtype="bfloat16",
            device="cuda",
            kernels=kernels,
            num_kv_blocks=64,
        )
        outs[kernels] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]
