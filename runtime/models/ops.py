"""KernelOps: the one interface through which the model and the engine call their hot kernels.

Two implementations share it: the Triton launchers (CUDA) and their pure-torch references
(everywhere else). `select_kernels("auto", device)` picks Triton on CUDA when triton is there,
the references otherwise; "torch" and "triton" force one (tests force both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kubeinfer import kernels

KernelChoice = Literal["auto", "torch", "triton"]


@dataclass(frozen=True, slots=True)
class KernelOps:
    name: Literal["torch", "triton"]
    rms_norm: Callable[..., Any]
    rotary_embedding: Callable[..., Any]
    silu_and_mul: Callable[..., torch.Tensor]
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


TORCH_OPS = KernelOps(
    "torch",
    kernels.rms_norm_reference,
    kernels.rotary_embedding_reference,
    kernels.silu_and_mul_reference,
    kernels.store_kv_reference,
    kernels.paged_attention_reference,
)
TRITON_OPS = KernelOps(
    "triton",
    kernels.rms_norm,
    kernels.rotary_embedding,
    kernels.silu_and_mul,
    kernels.store_kv,
    kernels.paged_attention,
)


def cpu_native_ops() -> KernelOps | None:
    """The torch path with the C++ CPU kernels for the elementwise ops (kernels/cpu_native.py),
    where they build; attention picks its C++ kernel itself (runtime/engine/attention.py)."""
    from kubeinfer.kernels import cpu_native

    if not cpu_native.load():
        return None
    return KernelOps(
        "torch",
        cpu_native.rms_norm_cpu,
        cpu_native.rotary_embedding_cpu,
        cpu_native.silu_and_mul_cpu,
        cpu_native.store_kv_cpu,
        kernels.paged_attention_reference,
    )


def select_kernels(choice: KernelChoice, device: torch.device) -> KernelOps:
    from kubeinfer.kernels.jit import is_interpreting

    can_triton = kernels.has_triton() and (device.type == "cuda" or is_interpreting())
    if choice == "torch" or (choice == "auto" and not can_triton):
        return TORCH_OPS
    if choice in ("auto", "triton"):
        if not can_triton:
            raise ValueError(
                "kernels=triton needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
                "use kernels=torch or auto"
            )
        return TRITON_OPS
    raise ValueError(f"kernels must be auto, torch or triton, got {choice!r}")
