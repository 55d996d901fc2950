"""ModelRunner: the only part of the engine that touches devices.

Each step it flattens the scheduled requests into one varlen batch (`input_ids, positions,
slot_mapping, block_tables, seq_lens, query_start_loc`), runs the model with the paged
attention backend over its KV cache, and samples a token for every request whose scheduled
tokens reach its end (a prefill chunk that does not is computed but not sampled).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kubeinfer.runtime.engine.attention import PagedAttention
from kubeinfer.runtime.engine.batch import BlockTableArray, build_step_batch
from kubeinfer.runtime.engine.config import EngineConfig
from kubeinfer.runtime.engine.sampler import Sampler, SamplingRow
from kubeinfer.runtime.engine.sched_output import SchedulerOutput
from kubeinfer.runtime.engine.staging import HostStaging
from kubeinfer.runtime.loader import ProgressCallback, load_model
from kubeinfer.runtime.models import LlamaForCausalLM
from kubeinfer.runtime.models.ops import select_kernels

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "cpu",
        on_progress: ProgressCallback | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.config = config
        model = load_model(
            model_dir,
            dtype=dtype,
            device=self.device,
            max_positions=config.max_model_len,
            on_progress=on_progress,
        )
        self.model: LlamaForCausalLM = model
        self.ops = select_kernels(config.kernels, self.device)
        model.use_kernels(self.ops)
        self.dtype = model.lm_head.weight.dtype
        self.max_model_len = model.max_positions
        mc = model.config
        self.block_size = config.block_size
        self.bytes_per_block = (
            2
            * mc.num_hidden_layers
            * self.block_size
            * mc.num_key_value_heads
            * mc.head_dim
            * self.dtype.itemsize
        )
        self.num_blocks = config.num_kv_blocks or self._blocks_from_memory()
        shape = (self.num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(mc.num_hidden_layers)
        ]
        self.block_tables = BlockTableArray(
            config.max_num_seqs, -(-self.max_model_len // self.block_size)
        )
        self.sampler = Sampler(self.device, config.seed)
        self.staging = HostStaging(self.device)  # pinned step metadata on CUDA
        self._generators: dict[str, torch.Generator] = {}
        logger.info(
            "KV cache: %d blocks of %d tokens (%.0f MiB)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.bytes_per_block / 2**20,
        )

    def _blocks_from_memory(self) -> int:
        fraction = self.config.kv_cache_memory_fraction
        if self.device.type == "cuda":
            # measure what a full step leaves free, then hand a fraction of it to the cache
            self._warm_up()
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * fraction)
        else:
            budget = int(self.config.kv_cache_memory_bytes * fraction)
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget} bytes)")
        return num_blocks

    @torch.inference_mode()
    def _warm_up(self) -> None:
        from kubeinfer.runtime.models import CausalAttention

        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        attn = CausalAttention.for_lengths([n], self.model.attention_scale)
        self.model.compute_logits(self.model(ids, torch.arange(n, device=self.device), attn))
        torch.cuda.synchronize(self.device)

    def release(self, request_id: str) -> None:
        """Forget a finished request (its generator, its block-table row)."""
        self._generators.pop(request_id, None)
        self.block_tables.release(request_id)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, block_ids: Callable[[str], list[int]]
    ) -> list[int | None]:
        """Run one step; one sampled token per scheduled request (None: prefill continues)."""
        for request_id in out.preempted_ids:  # their blocks are gone; rows are re-made later
            self.block_tables.release(request_id)
        batch = build_step_batch(out, block_ids, self.block_size, self.block_tables)
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
        hidden = self.model(put(batch.input_ids), put(batch.positions), attn)
        results: list[int | None] = [None] * len(out.scheduled)
        sampling = batch.sample_rows
        if not sampling:
            return results
        logits = self.model.compute_logits(hidden[put(np.array(batch.logits_indices))])
        rows = [self._sampling_row(out.scheduled[i].request) for i in sampling]
        for i, token in zip(sampling, self.sampler(logits, rows), strict=True):
            results[i] = token
        return results

    def _sampling_row(self, request) -> SamplingRow:  # noqa: ANN001
        params = request.sampling_params
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = self._generators.get(request.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
                self._generators[request.request_id] = generator
        banned: list[int] = []
        if request.num_output_tokens < params.min_tokens:
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned += list(request.eos_token_ids)
        return SamplingRow(params, generator, banned)
