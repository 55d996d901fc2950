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
            # (L, H, D) -> (H, L, D) for SDPA
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            mask = self._window_mask(end - start, q.device)
            o = F.scaled_dot_product_attention(
                qs,
                ks,
                vs,
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
                enable_gqa=qs.shape[0] != ks.shape[0],
            )
            out[start:end] = o.transpose(0, 1)
        return out

    def _window_mask(self, n: int, device: torch.device) -> torch.Tensor | None:
        if self.sliding_window is None or n <= self.sliding_window:
            return None
        i = torch.arange(n, device=device)
        diff = i[:, None] - i[None, :]  # query index - key index
        return (diff >= 0) & (diff < self.sliding_window)
