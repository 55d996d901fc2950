"""Every launch the kernels make on a GPU compiles for sm_90 (and sm_80), with no GPU present.

The interpreter runs the kernels' Python, not triton's compiler, so code it accepts can still
fail to compile (types of loop-carried values, dot shapes, unsupported ops). Here each launcher
runs on CPU tensors of the GPU dtypes with triton's launch replaced by a recorder, and the
recorded signature is compiled ahead of time down to a cubin (triton ships ptxas). Needs triton
in compiled mode, so it is skipped inside the interpreter run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import kubeinfer.kernels as K
from kubeinfer.kernels import jit as kernels_jit
from tests.kernels.test_references import make_case

triton = pytest.importorskip("triton")

OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}


def record(monkeypatch: pytest.MonkeyPatch, call: Callable[[], object]) -> list[tuple[Any, ...]]:
    """The (kernel, args, kwargs) of each launch `call` makes; nothing runs."""
    from triton.runtime.jit import JITFunction

    launches: list[tuple[Any, ...]] = []

    def launcher(self: Any, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: launches.append((self, args, kwargs))

    monkeypatch.setattr(JITFunction, "__getitem__", launcher)
    monkeypatch.setattr(kernels_jit, "_INTERPRET", True)  # let CPU tensors past the launch check
    call()
    return launches


def compile_launch(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], arch: int) -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    options = {name: kwargs.pop(name) for name in OPTIONS if name in kwargs}
    signature: dict[str, str] = {}
    positional = [name for name in fn.arg_names if name not in kwargs]
    for name, value in zip(positional, args, strict=True):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    signature.update(dict.fromkeys(kwargs, "constexpr"))
    source = ASTSource(fn, signature, constexprs=kwargs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def attention_case(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> list[Any]:
    case = make_case([1, 1, 9], [0, 40, 3], heads, kv_heads, head_dim)
    return [t.to(dtype) if t.is_floating_point() else t for t in case]


BF16 = torch.bfloat16
x, w = torch.randn(4, 4096, dtype=BF16), torch.ones(4096, dtype=BF16)
q, k = torch.randn(4, 32, 128, dtype=BF16), torch.randn(4, 8, 128, dtype=BF16)
cache = torch.zeros(3, 16, 8, 128, dtype=BF16)
LAUNCHES: dict[str, Callable[[], object]] = {
    "rms_norm": lambda: K.rms_norm(x, w, 1e-6),
    "rms_norm+residual": lambda: K.rms_norm(x, w, 1e-6, x),
    "silu_and_mul": lambda: K.silu_and_mul(torch.randn(4, 2 * 14336, dtype=BF16)),
    "rotary_neox": lambda: K.rotary_embedding(torch.arange(4), q, k, torch.randn(9, 128), True),
    "rotary_gptj": lambda: K.rotary_embedding(torch.arange(4), q, k, torch.randn(9, 64), False),
    "store_kv": lambda: K.store_kv(k, k, cache, cache.clone(), torch.arange(4)),
    "attention_prefill_bf16": lambda: K.paged_attention(*attention_case(BF16, 32, 8, 128), 0.1),
    "attention_decode_window_bf16": lambda: K.paged_attention(
        *attention_case(BF16, 32, 4, 64), 0.1, 16, max_query_len=1, num_splits=1
    ),
    "attention_split_kv_bf16": lambda: K.paged_attention(
        *attention_case(BF16, 8, 8, 128), 0.1, max_query_len=1, num_splits=4
    ),
    "attention_odd_fp16": lambda: K.paged_attention(*attention_case(torch.float16, 6, 2, 80), 0.1),
    "attention_fp32": lambda: K.paged_attention(*attention_case(torch.float32, 8, 1, 64), 0.1),
}


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_launch_compiles_for_sm90(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    if kernels_jit.is_interpreting():
        pytest.skip("triton is in interpreter mode in this process")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("triton has no nvidia backend")
    launches = record(monkeypatch, LAUNCHES[name])
    assert launches, f"{name} launched nothing"
    monkeypatch.undo()  # compile with triton's own launch path restored
    archs = (90, 80) if name == "attention_prefill_bf16" else (90,)
    for fn, args, kwargs in launches:
        for arch in archs:
            compiled = compile_launch(fn, args, kwargs, arch)
            assert compiled.asm["cubin"], f"{fn.__name__} produced no cubin for sm_{arch}"
