"""Linear layers with their weights prepacked for oneDNN, for bfloat16 and float16 on CPU.

`torch.nn.functional.linear` in bfloat16 on CPU goes to oneDNN, which reorders the weight into
its blocked layout on every call; for the small row counts of decode steps that reorder is most
of the cost. `pack_linears(model)` replaces each `nn.Linear` with a `PackedLinear` that holds the
weight reordered once (`torch.ops.mkldnn._reorder_linear_weight`) and runs
`torch.ops.mkldnn._linear_pointwise` (what inductor's CPU freezing emits), and frees the plain
weight (a tied LM head packs a copy; the embedding keeps its table). Measured on the dev
machine (Xeon with AMX, 2 threads), bfloat16: 1.3-2x faster at 16-256 rows, about even at 1,
mixed at 1024 (0.6-1.1x over four layer shapes).

float32, as vLLM's CPU backend does it (oneDNN with prepacked weights): 1.2-1.8x faster than
MKL's sgemm at 4-32 rows (MKL has a cliff between 2 and 4 rows), even from 64 up, but on Intel
CPUs 1.5-2.5x slower at 1-2 rows, where MKL on the plain weight stays there: float32 keeps both
layouts (twice the linear weights' memory) while the plain ones total at most `DUAL_MAX_BYTES`;
above that only the packed (vLLM's choice). Elsewhere MKL takes its generic path: on the AMD
EPYC dev machine it is 1-3x slower than the packed weights at 1-2 rows (the 49152x576 LM head at
one row: 10.0 vs 3.4 ms; served float32 at concurrency 1 went at 52 ms per token against vLLM's
31), so only the packed are kept (`mkl_few_rows`). The greedy parity tests with transformers
hold with either.

bfloat16 and float16 where oneDNN has no kernel for them (it needs AVX512-BW/VL/DQ or
AVX-NE-CONVERT; an AVX2-only CPU has neither) compute in float32 (`pack_dtype`): the weights
upcast once and packed, each call's input converted up and its output back. That is the same
arithmetic as a half-precision GEMM with float32 accumulation (the products of two bfloat16
values are exact in float32), at float32's speed: on the AVX2-only AMD EPYC dev machine the
plain bfloat16 `aten::mm` took 82 % of a step and SmolLM2 went at 24.7 output tokens/s against
float32's 104.8 (vLLM's CPU build: 25.2 there). The weights then take float32's memory; the KV
cache stays in the model's dtype.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def can_pack(dtype: torch.dtype) -> bool:
    """oneDNN packing works here for `dtype` (checked on a small layer, once per dtype)."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype not in _CHECKED:
        try:
            w = torch.randn(8, 16).to(dtype)
            x = torch.randn(3, 16).to(dtype)
            got = torch.ops.mkldnn._linear_pointwise(
                x, torch.ops.mkldnn._reorder_linear_weight(w, None), None, "none", [], ""
            )
            want = torch.nn.functional.linear(x.float(), w.float())
            _CHECKED[dtype] = bool(torch.allclose(got.float(), want, atol=0.1, rtol=0.05))
        except (RuntimeError, AttributeError) as e:
            logger.info("oneDNN weight packing unavailable for %s: %s", dtype, e)
            _CHECKED[dtype] = False
    return _CHECKED[dtype]


_CHECKED: dict[torch.dtype, bool] = {}


def pack_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a model of `dtype` runs its packed linears in: its own where oneDNN has a
    kernel for it, float32 for bfloat16/float16 where it has none (see the module docstring),
    None where nothing packs."""
    if can_pack(dtype):
        return dtype
    if dtype in (torch.bfloat16, torch.float16) and can_pack(torch.float32):
        return torch.float32
    return None


FEW_ROWS = 2
"""float32 at this many rows or fewer runs MKL on the plain weight (see the module docstring)."""


def _linear_op():  # noqa: ANN202 - an OpOverload, or None where torch has no oneDNN
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


_LINEAR = _linear_op()
"""oneDNN's linear with a packed weight, resolved once (its overload: called directly)."""


class PackedLinear(nn.Module):
    """`y = x W^T + b` with W held in oneDNN's layout. `weight` is a meta tensor with the
    plain weight's shape and dtype, for code that only asks about them; `plain`, when kept,
    serves the few-row calls. `compute`: the dtype the product runs in when it is not the
    weight's (float32 for a half-precision layer oneDNN has no kernel for): the weight is packed
    in it, and each input converted to it and the output back."""

    def __init__(
        self, linear: nn.Linear, keep_plain: bool = False, compute: torch.dtype | None = None
    ) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute = None if compute in (None, w.dtype) else compute
        self.weight = torch.empty(w.shape, dtype=w.dtype, device="meta")
        bias = None if linear.bias is None else linear.bias.detach()
        if self.compute is not None:
            w, keep_plain = w.to(self.compute), False
            bias = None if bias is None else bias.to(self.compute)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        self.bias = bias
        self.plain = w if keep_plain else None  # the same storage (a tied head: the embedding's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute is None:
            return self._forward(x)
        return self._forward(x.to(self.compute)).to(x.dtype)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the engine's flat token batches: no reshapes (8 us a call of 17)
            rows = x.shape[0]
            if rows > FEW_ROWS or self.plain is None:
                if rows <= 16 or bucket_rows(rows) == rows:
                    return _LINEAR(x, self.packed, self.bias, "none", [], "")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        rows = x2.shape[0]
        if self.plain is not None and rows <= FEW_ROWS:
            return torch.nn.functional.linear(x, self.plain, self.bias)
        padded = bucket_rows(rows)
        if padded != rows:  # a row count oneDNN has a primitive for (see bucket_rows)
            xp = x2.new_empty((padded, x2.shape[1]))
            xp[:rows] = x2
            xp[rows:] = 0
            x2 = xp
        y = _LINEAR(x2, self.packed, self.bias, "none", [], "")
        return y[:rows].view(*shape[:-1], self.out_features)


def bucket_rows(rows: int) -> int:
    """The row count a linear runs at: `rows` rounded up to a bucket (exact up to 16, then
    multiples of 4 to 64, doubling the step at every doubling of the rows: 8 to 128, ..., 128
    to 2048, 256 beyond), so at most 18 % padding.

    oneDNN builds a primitive for every new shape (1.7 ms for a 576x1536 bfloat16 layer on
    the dev machine, against 0.15 ms for the product itself) and keeps 1024 in its cache; the
    engine's row counts (decode batches, prefill chunks, mixes of both) take hundreds of values,
    so without buckets a run kept building primitives: a cold 64-request bfloat16 run went at
    a fraction of a warm one's speed. With them a model has a bounded set of shapes (68 per
    layer shape up to 2048 rows)."""
    if rows <= 16:
        return rows
    for limit, step in ((64, 4), (128, 8), (256, 16), (512, 32), (1024, 64), (2048, 128)):
        if rows <= limit:
            return -(-rows // step) * step
    return -(-rows // 256) * 256


DUAL_MAX_BYTES = 4 << 30
"""float32 keeps the plain weights beside the packed ones while they total at most this."""


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The CPU's vendor id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"), "" if unknown."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return ""


@functools.cache
def mkl_few_rows() -> bool:
    """float32 runs its 1-2 row calls on MKL with the plain weight: on Intel CPUs only, where
    MKL's own kernels run (see the module docstring)."""
    return cpu_vendor() == "GenuineIntel"


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear` (in `pack_dtype` of its
    weights' dtype); how many were replaced."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    size = sum(c.weight.numel() * c.weight.element_size() for _, _, c in targets)
    keep_plain = bool(targets) and targets[0][2].weight.dtype == torch.float32
    keep_plain = keep_plain and size <= DUAL_MAX_BYTES and mkl_few_rows()
    compute = pack_dtype(targets[0][2].weight.dtype) if targets else None
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, keep_plain, compute))
    return len(targets)
