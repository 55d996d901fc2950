"""Kernels for the model's hot paths: a Triton launcher and a pure-torch `<name>_reference` each.

Both functions of a pair take the same arguments and check them the same way (shape, dtype,
device, layout; a `KernelInputError` names the tensor). The Triton launchers need CUDA tensors,
or `TRITON_INTERPRET=1` to run in triton's interpreter on CPU; the references run anywhere.
Importing this package never needs triton or a GPU (see `kubeinfer.kernels.jit`).
"""

from kubeinfer.kernels.checks import KernelInputError
from kubeinfer.kernels.jit import has_triton
from kubeinfer.kernels.paged_attention import paged_attention, paged_attention_reference
from kubeinfer.kernels.rms_norm import rms_norm, rms_norm_reference
from kubeinfer.kernels.rotary_embedding import rotary_embedding, rotary_embedding_reference
from kubeinfer.kernels.silu_and_mul import silu_and_mul, silu_and_mul_reference
from kubeinfer.kernels.store_kv import store_kv, store_kv_reference

__all__ = [
    "KernelInputError",
    "has_triton",
    "paged_attention",
    "paged_attention_reference",
    "rms_norm",
    "rms_norm_reference",
    "rotary_embedding",
    "rotary_embedding_reference",
    "silu_and_mul",
    "silu_and_mul_reference",
    "store_kv",
    "store_kv_reference",
]
