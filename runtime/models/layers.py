"""The building blocks of a Llama-family decoder, on flat token batches `[num_tokens, ...]`.

Every module works on the step's tokens laid end to end (no padding, no batch dimension), which
is the layout the engine's paged attention consumes too. The numerics follow transformers' so
that float32 logits agree to ~1e-6.
"""

from __future__ import annotations

import math
from typing import overload

import torch
from torch import nn

from kubeinfer.runtime.models.config import ModelConfig, RopeConfig
from kubeinfer.runtime.models.ops import TORCH_OPS, KernelOps
from kubeinfer.runtime.models.parallel import SINGLE, TPGroup, TPLayout


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 and cast back (as transformers)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.ops: KernelOps = TORCH_OPS

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, `(norm(x + residual), x + residual)` in one kernel."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        if residual is None:
            return self.ops.rms_norm(x2, self.weight, self.eps).view(shape)
        r2 = residual.reshape(-1, shape[-1]).contiguous()
        out, new_residual = self.ops.rms_norm(x2, self.weight, self.eps, r2)
        return out.view(shape), new_residual.view(shape)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), with linear or llama3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band
        # between low_freq_factor and high_freq_factor interpolated smoothly.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding from a cos/sin cache `[max_positions, head_dim]`.

    The cache is not a parameter: `materialize(device)` computes it once the module has real
    storage (the model is built on the meta device).
    """

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.rope = head_dim, max_positions, rope
        self.cos_sin_cache: torch.Tensor | None = None
        self.ops: KernelOps = TORCH_OPS

    def materialize(self, device: torch.device) -> None:
        inv_freq = rope_inv_freq(self.rope, self.head_dim).to(device)
        t = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (max_positions, head_dim / 2)
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: (T, H, D), k: (T, Hkv, D), positions: (T,); rotated in place
        assert self.cos_sin_cache is not None, "materialize() was not called"
        return self.ops.rotary_embedding(positions, q, k, self.cos_sin_cache, True)


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one projection: down(silu(gate(x)) * up(x)).

    Under tensor parallelism gate/up are column-parallel (this rank's intermediate columns)
    and down row-parallel: one all-reduce sums the ranks' partial outputs (the bias, on rank 0
    only, is in the sum once)."""

    def __init__(
        self, config: ModelConfig, tp: TPGroup = SINGLE, layout: TPLayout | None = None
    ) -> None:
        super().__init__()
        layout = layout or TPLayout.of(config, tp)
        self.tp = tp
        self.intermediate_size = layout.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            self.intermediate_size, config.hidden_size, bias=config.mlp_bias and tp.rank == 0
        )
        self.ops: KernelOps = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))))
