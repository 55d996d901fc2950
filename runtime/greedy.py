"""Greedy decoding by whole-sequence recompute: no KV cache, one sequence.

The simplest correct decoder, used by `kubeinfer generate` until the engine (paged KV cache,
continuous batching) takes over, and kept as a reference for it: each step runs the full
sequence through the model with `CausalAttention` and takes the argmax of the last position.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

import torch

from kubeinfer.runtime.models import CausalAttention, LlamaForCausalLM


@torch.inference_mode()
def greedy_tokens(
    model: LlamaForCausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Collection[int] = (),
) -> Iterator[int]:
    """Yield up to `max_new_tokens` greedy tokens; stops after yielding an EOS token."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    device = next(model.parameters()).device
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        if len(ids) > model.max_positions:
            return
        input_ids = torch.tensor(ids, device=device)
        positions = torch.arange(len(ids), device=device)
        attn = CausalAttention.for_lengths([len(ids)], model.attention_scale)
        hidden = model(input_ids, positions, attn)
        token = int(model.compute_logits(hidden[-1:]).argmax(dim=-1).item())
        yield token
        if token in eos_token_ids:
            return
        ids.append(token)
