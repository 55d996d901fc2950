"""Tensor parallelism of the Llama-family decoder (Megatron-style), as vLLM shards it.

Rank r of N holds:
- q heads `[r * H/N, (r+1) * H/N)`; KV heads `[r * Hkv/N, ...)` when N divides Hkv, else (N a
  multiple of Hkv) the one KV head its q heads read, `r // (N / Hkv)`, replicated;
- q/k/v and gate/up column-parallel (their output rows), o_proj and down_proj row-parallel
  (their input columns), each followed by one all-reduce of the partial sums (a row-parallel
  bias is added on rank 0 only, so the sum holds it once);
- the embedding and the LM head vocab-parallel: `ceil(V/N)` rows each (the last rank's tail
  past V is zero padding). The embedding all-reduces masked lookups; the LM head's partial
  logits are gathered on rank 0, which samples.
Norms, rotary and everything else is replicated. With N = 1 the model is the plain one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kubeinfer.runtime.models.config import ModelConfig


class TensorParallelError(ValueError):
    """A tensor-parallel size that this model (or this machine) cannot be split over."""


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This process's rank in its tensor-parallel group; `group` is the torch.distributed
    process group of the math (None with one rank)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` joined along the last dimension, on rank 0 (None elsewhere)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=_global_rank(self.group, 0), group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None


def _global_rank(group: Any, rank: int) -> int:
    import torch.distributed as dist

    return dist.get_global_rank(group, rank) if group is not None else rank


SINGLE = TPGroup()


@dataclass(frozen=True, slots=True)
class TPLayout:
    """What one rank holds of each sharded dimension (see the module docstring)."""

    num_heads: int
    head_start: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    intermediate_start: int
    vocab_rows: int  # rows of this rank's vocabulary shard, padding included
    vocab_start: int
    num_real_vocab_rows: int  # of them, the real vocabulary's (the rest is zero padding)

    @classmethod
    def of(cls, config: ModelConfig, tp: TPGroup) -> TPLayout:
        check_tp_size(config, tp.size)
        n, r = tp.size, tp.rank
        heads = config.num_attention_heads // n
        kv = config.num_key_value_heads
        if kv >= n:
            kv_heads, kv_start = kv // n, r * (kv // n)
        else:
            kv_heads, kv_start = 1, r // (n // kv)
        inter = config.intermediate_size // n
        vocab = -(-config.vocab_size // n)
        vocab_start = r * vocab
        real = max(0, min(config.vocab_size - vocab_start, vocab))
        return cls(heads, r * heads, kv_heads, kv_start, inter, r * inter, vocab, vocab_start, real)


def check_tp_size(config: ModelConfig, size: int) -> None:
    """TensorParallelError naming the dimension when the model cannot be split `size` ways."""
    if size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, not {size}")
    if size == 1:
        return
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise TensorParallelError(
            f"tensor_parallel_size {size} does not divide the model's {heads} attention heads"
        )
    if kv % size and size % kv:
        raise TensorParallelError(
            f"tensor_parallel_size {size} does not divide the model's {kv} KV heads, "
            "nor is it a multiple of them"
        )
    if config.intermediate_size % size:
        raise TensorParallelError(
            f"tensor_parallel_size {size} does not divide the model's intermediate_size "
            f"{config.intermediate_size}"
        )


class VocabParallelEmbedding(nn.Module):
    """This rank's rows `[start, start + rows)` of the table; a lookup sums every rank's (each
    id is in exactly one shard, the others contribute zeros)."""

    def __init__(self, layout: TPLayout, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.start, self.rows, self.tp = layout.vocab_start, layout.vocab_rows, tp
        self.weight = nn.Parameter(torch.empty(layout.vocab_rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)
