"""ModelShard: one rank's model on its device, its kernels and its share of the KV cache.

With one rank it is the whole model. Under tensor parallelism (models/parallel.py) every rank,
the driver's and each worker process's (tp_workers.py), holds one: its slices of the weights,
the KV cache of its heads, and the same `forward` and `logits` calls, made in lockstep so that
their collectives pair up. Scheduling, block tables, sampling and every per-request state live
in the driver's ModelRunner only.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from kubeinfer.runtime.engine.attention import PagedAttention
from kubeinfer.runtime.engine.batch import StepBatch
from kubeinfer.runtime.engine.config import EngineConfig
from kubeinfer.runtime.engine.staging import HostStaging
from kubeinfer.runtime.loader import ProgressCallback, load_model
from kubeinfer.runtime.models import LlamaForCausalLM
from kubeinfer.runtime.models.cpu_linear import pack_dtype, pack_linears
from kubeinfer.runtime.models.ops import TORCH_OPS, cpu_native_ops, select_kernels
from kubeinfer.runtime.models.parallel import SINGLE, TPGroup

logger = logging.getLogger(__name__)

PROMPT_LOGPROBS_ROWS = 256
"""Prompt positions per logits slice when computing prompt logprobs: (256, vocab) float32 is
50 MB for a 49k vocabulary, where a whole 2048-token chunk at once would be 400 MB."""


class ModelShard:
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        on_progress: ProgressCallback | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        self.device = torch.device(device)
        self.config = config
        self.tp = tp
        model = load_model(
            model_dir,
            dtype=dtype,
            device=self.device,
            max_positions=config.max_model_len,
            on_progress=on_progress,
            tp=tp,
        )
        self.model: LlamaForCausalLM = model
        self.ops = select_kernels(config.kernels, self.device)
        if self.ops is TORCH_OPS and self.device.type == "cpu":
            self.ops = cpu_native_ops() or TORCH_OPS
        model.use_kernels(self.ops)
        self.dtype = model.lm_head.weight.dtype
        self.max_model_len = model.max_positions
        if (
            self.device.type == "cpu"
            and self.ops is not TORCH_OPS  # the C++ kernels are on
            and pack_dtype(self.dtype) is not None
        ):
            logger.info(
                "prepacked %d linear layers for oneDNN (computing in %s)",
                pack_linears(model),
                pack_dtype(self.dtype),
            )
        mc = model.config
        self.num_kv_heads = model.layout.num_kv_heads  # this rank's
        self.bytes_per_block = (
            2
            * mc.num_hidden_layers
            * config.block_size
            * self.num_kv_heads
            * mc.head_dim
            * self.dtype.itemsize
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.staging = HostStaging(self.device)  # pinned step metadata on CUDA

    def blocks_from_memory(self) -> int:
        """KV blocks this rank's memory holds: on CUDA a fraction of what a full step (a
        warm-up, which every rank runs at once) leaves free; on CPU of the configured bytes
        (per rank, as vLLM's CPU workers each take VLLM_CPU_KVCACHE_SPACE)."""
        fraction = self.config.kv_cache_memory_fraction
        if self.device.type == "cuda":
            self._warm_up()
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * fraction)
        else:
            budget = int(self.config.kv_cache_memory_bytes * fraction)
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget} bytes)")
        return num_blocks

    def allocate_kv(self, num_blocks: int) -> None:
        mc = self.model.config
        shape = (num_blocks, self.config.block_size, self.num_kv_heads, mc.head_dim)
        self.num_blocks = num_blocks
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(mc.num_hidden_layers)
        ]

    @torch.inference_mode()
    def _warm_up(self) -> None:
        from kubeinfer.runtime.models import CausalAttention

        n = min(self.config.max_num_batched_tokens or 8192, self.max_model_len)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        attn = CausalAttention.for_lengths([n], self.model.attention_scale)
        hidden = self.model(ids, torch.arange(n, device=self.device), attn)
        # the most logits rows a step holds: its sampled rows, or one prompt-logprobs slice
        self.model.compute_logits(hidden[: max(self.config.max_num_seqs, PROMPT_LOGPROBS_ROWS)])
        torch.cuda.synchronize(self.device)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """The step's hidden states (T, hidden); call under inference_mode."""
        self.staging.begin_step()
        put = self.staging.put
        attn = PagedAttention(
            self.kv_caches,
            batch,
            self.device,
            self.model.attention_scale,
            self.model.config.sliding_window,
            self.ops,
            put=put,
        )
        return self.model(put(batch.input_ids), put(batch.positions), attn)

    def sample_logits(self, hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor | None:
        """Logits of the rows the step samples (full vocabulary; None on a worker rank)."""
        return self.model.compute_logits(hidden[self.staging.put(np.array(batch.logits_indices))])

    @torch.inference_mode()
    def run_step(self, batch: StepBatch, slices: list[tuple[int, int]]) -> None:
        """A worker rank's share of a step, the same calls in the same order as the driver's
        `ModelRunner.execute`: forward, the sampled rows' logits, then each prompt-logprobs
        slice `hidden[lo:hi]`'s logits."""
        hidden = self.forward(batch)
        if batch.sample_rows:
            self.sample_logits(hidden, batch)
        for lo, hi in slices:
            self.model.compute_logits(hidden[lo:hi])
