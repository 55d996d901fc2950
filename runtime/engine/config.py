"""EngineConfig: every engine knob, validated and documented (the server maps CLI/env to it)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_model_len: int | None = Field(None, ge=2)
    """Longest sequence (prompt + output); default: the model's max_position_embeddings."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences running in one step."""
    max_num_batched_tokens: int | None = Field(None, ge=1)
    """Token budget of one step; longer prompts are prefilled in chunks. Default:
    `default_batched_tokens(device)`."""
    block_size: int = Field(16, ge=1, le=256)
    """Tokens per KV cache block."""
    num_kv_blocks: int | None = Field(None, ge=1)
    """KV pool size in blocks; default: sized from the memory settings below."""
    kv_cache_memory_fraction: float = Field(0.9, gt=0.0, le=1.0)
    """GPU: fraction of free memory (after a warm-up) for KV; CPU: of kv_cache_memory_bytes."""
    kv_cache_memory_bytes: int = Field(2 << 30, ge=1 << 20)
    """CPU only: the byte budget the fraction applies to (per tensor-parallel rank, as vLLM's
    CPU workers each take VLLM_CPU_KVCACHE_SPACE)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of shared prompt prefixes across requests."""
    seed: int = 0
    """Seed of the sampler for requests without their own seed."""
    max_consecutive_step_failures: int = Field(3, ge=1)
    """Solo steps in a row that may fail (each failing its request) before the engine stops:
    past that, the fault is taken to be the device's, not a request's."""
    kernels: Literal["auto", "torch", "triton"] = "auto"
    """Attention/norm kernels: Triton on CUDA when auto, the torch references elsewhere."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """Devices one replica spans (Megatron-style tensor parallelism, one worker process per
    rank: NCCL on GPUs, gloo on CPU). It must divide the model's attention heads, and its KV
    heads or be a multiple of them (KV heads are then replicated)."""
    tp_timeout_s: float = Field(120.0, gt=0.0)
    """Tensor parallelism: longest wait for a collective or a rank's reply before the engine
    is failed (a hung or dead rank then fails /health instead of hanging the server)."""


def default_batched_tokens(device: str | torch.device, serving: bool = False) -> int:
    """vLLM's defaults: 8192 on a GPU; on CPU 4096 offline and 2048 served, where a step's
    linears run slower per row past ~4096 rows (measured on the dev machine: 8192-row steps
    ~1.5x the time per row of 2048-4096) and a shorter prefill chunk holds up the decodes
    sharing its step for less time."""
    if torch.device(device).type == "cpu":
        return 2048 if serving else 4096
    return 8192
