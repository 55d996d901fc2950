"""The seam between the model and the KV cache: an attention backend, chosen per step.

A decoder layer computes q, k, v for the step's new tokens, applies rotary, and hands them to
`backend.forward(layer_idx, q, k, v)`. The backend owns everything about history: this module's
`CausalAttention` has none (each sequence is whole in the step, as in a full-sequence forward);
the engine's paged backend writes k/v into its block cache and attends over it. The model code
is the same for both.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q: (T, H, D), k and v: (T, Hkv, D) for the step's T new tokens -> (T, H, D)."""
        ...


class CausalAttention:
    """Whole sequences laid end to end; `query_start_loc[i]:query_start_loc[i+1]` is sequence i.

    Causal within each sequence, optionally limited to a sliding window of `sliding_window` keys.
    """

    def __init__(
        self, query_start_loc: list[int], scale: float, sliding_window: int | None = None
    ) -> None:
        self.query_start_loc, self.scale, self.sliding_window = (
            query_start_loc,
            scale,
            sliding_window,
        )

    @classmethod
    def for_lengths(
        cls, seq_lens: list[int], scale: float, sliding_window: int | None = None
    ) -> CausalAttention:
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        return cls(starts, scale, sliding_window)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        for start, end in zip(self.query_start_loc[:-1], self.query_start_loc[1:], strict=True):
            mask = window_mask(end - start, self.sliding_window, q.device)
            out[start:end] = causal_sdpa(q[start:end], k[start:end], v[start:end], self.scale, mask)
        return out


def window_mask(
    n: int, sliding_window: int | None, device: torch.device | str = "cpu"
) -> torch.Tensor | None:
    """(n, n) True where query i sees key j (j <= i, i - j < window); None when plain causal."""
    if sliding_window is None or n <= sliding_window:
        return None
    i = torch.arange(n, device=device)
    diff = i[:, None] - i[None, :]  # query index - key index
    return (diff >= 0) & (diff < sliding_window)


def causal_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One whole sequence over its own keys: q (n, H, D), k and v (n, Hkv, D) -> (n, H, D);
    causal, or `mask` (from `window_mask`) when given."""
    o = F.scaled_dot_product_attention(  # (H, n, D) over (Hkv, n, D)
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return o.transpose(0, 1)
