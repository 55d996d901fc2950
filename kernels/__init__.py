"""Kernels for the model's hot paths, each with a pure-torch `<name>_reference`.

The runtime calls these through one interface: the Triton launchers on CUDA (the kernels
issue), the references elsewhere.
"""

from kubeinfer.kernels.checks import KernelInputError
from kubeinfer.kernels.paged_attention import paged_attention_reference
from kubeinfer.kernels.store_kv import store_kv_reference

__all__ = ["KernelInputError", "paged_attention_reference", "store_kv_reference"]
