"""ModelRunner: the only part of the engine that touches devices.

Each step it flattens the scheduled requests into one varlen batch (`input_ids, positions,
slot_mapping, block_tables, seq_lens, query_start_loc`), runs the model with the paged
attention backend over its KV cache, and samples a token for every request whose scheduled
tokens reach its end (a prefill chunk that does not is computed but not sampled).

A step is `prepare` then `execute`. `prepare` does, per request and before any compute, all
that can fail for one request alone, so that such a failure is pinned on that request and the
rest of the batch is unaffected; `execute` is the batched forward pass and sampling, whose
failure the engine rolls back (`roll_back`) and isolates (see isolation.py).
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
from kubeinfer.runtime.engine.guided import GrammarMatchers
from kubeinfer.runtime.engine.outputs import TokenLogprob
from kubeinfer.runtime.engine.penalties import TokenCounts
from kubeinfer.runtime.engine.request import Request
from kubeinfer.runtime.engine.runner_output import RunnerOutput
from kubeinfer.runtime.engine.sampler import Sampler, SamplingRow, top_logprobs
from kubeinfer.runtime.engine.sched_output import ScheduledRequest, SchedulerOutput
from kubeinfer.runtime.engine.staging import HostStaging
from kubeinfer.runtime.engine.validation import check_token_ids
from kubeinfer.runtime.loader import ProgressCallback, load_model
from kubeinfer.runtime.models import LlamaForCausalLM
from kubeinfer.runtime.models.cpu_linear import can_pack, pack_linears
from kubeinfer.runtime.models.ops import TORCH_OPS, cpu_native_ops, select_kernels

logger = logging.getLogger(__name__)

PROMPT_LOGPROBS_ROWS = 256
"""Prompt positions per logits slice when computing prompt logprobs: (256, vocab) float32 is
50 MB for a 49k vocabulary, where a whole 2048-token chunk at once would be 400 MB."""


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
        if self.ops is TORCH_OPS and self.device.type == "cpu":
            self.ops = cpu_native_ops() or TORCH_OPS
        model.use_kernels(self.ops)
        self.dtype = model.lm_head.weight.dtype
        self.max_model_len = model.max_positions
        mc = model.config
        self.vocab_size = mc.vocab_size
        self.num_logits = model.lm_head.weight.shape[0]  # the sampler's row width
        if (
            self.device.type == "cpu"
            and self.ops is not TORCH_OPS  # the C++ kernels are on
            and can_pack(self.dtype)
        ):
            logger.info("prepacked %d linear layers for oneDNN", pack_linears(model))
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
        self.token_counts = TokenCounts(self.num_logits, self.device)  # penalties' state
        self.staging = HostStaging(self.device)  # pinned step metadata on CUDA
        self._generators: dict[str, torch.Generator] = {}
        self.grammar_matchers = GrammarMatchers(self.num_logits)  # guided requests' state
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
        """Forget a finished request (its generator, its rows, its grammar matcher)."""
        self._generators.pop(request_id, None)
        self._release_rows(request_id)

    def roll_back(self, step_ids: list[str], preempted_ids: list[str]) -> None:
        """Forget what a failed step may have half-done: the rows of the preempted requests
        (their blocks are gone), and the generators of the step's requests (the step may have
        drawn from them; `_sampling_row` rebuilds each from its seed)."""
        for request_id in preempted_ids:
            self._release_rows(request_id)
        for request_id in step_ids:
            self._generators.pop(request_id, None)

    def _release_rows(self, request_id: str) -> None:
        """A request's per-request device state, rebuilt from its tokens if it runs again:
        block-table row, token-count row, grammar matcher (re-synced by `prepare`)."""
        self.block_tables.release(request_id)
        self.token_counts.release(request_id)
        self.grammar_matchers.release(request_id)

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[list[SamplingRow | None], dict[int, Exception]]:
        """Per-request work of a step, before any compute. Returns a sampling row per scheduled
        request (None when it samples nothing this step) and the requests that cannot run, by
        index, with their errors.

        Checked here: the tokens to compute are in the vocabulary (a prompt that got past
        validation would index the embedding out of bounds: on CUDA a device-side assert,
        which no process survives), the banned ids are, and a seeded generator can be made;
        a guided request's matcher is brought in step with its output (`GrammarMatchers.sync`).
        """
        for request_id in out.preempted_ids:  # their blocks are gone; rows are re-made later
            self._release_rows(request_id)
        rows: list[SamplingRow | None] = []
        failures: dict[int, Exception] = {}
        for i, s in enumerate(out.scheduled):
            try:
                _check_new_prompt_ids(s, self.vocab_size)
                row = None
                if s.completes_prefill:
                    row = self._sampling_row(s.request)
                    self.grammar_matchers.sync(s.request)
                rows.append(row)
            except Exception as e:  # noqa: BLE001 - any error here belongs to this request
                rows.append(None)
                failures[i] = e
        return rows, failures

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        block_ids: Callable[[str], list[int]],
        rows: list[SamplingRow | None],
    ) -> RunnerOutput:
        """Run one step: a sampled token per scheduled request (None: prefill continues), with
        the logprobs the requests ask for. `rows` come from `prepare` for the same step."""
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
        num_scheduled = len(out.scheduled)
        result = RunnerOutput([None] * num_scheduled, [None] * num_scheduled)
        for i, s in enumerate(out.scheduled):
            if s.request.needs_prompt_logprobs:
                start = int(batch.query_start_loc[i])
                result.prompt_logprobs[i] = self._prompt_logprobs(s, hidden, start)
        sampling = batch.sample_rows
        if not sampling:
            return result
        logits = self.model.compute_logits(hidden[put(np.array(batch.logits_indices))])
        if self.grammar_matchers.num_matchers:  # guided decoding: forbidden tokens to -inf
            self.grammar_matchers.mask_logits(logits, [out.scheduled[i].request for i in sampling])
        sample_rows = [row for i in sampling if (row := rows[i]) is not None]
        if len(sample_rows) != len(sampling):
            raise RuntimeError("prepare() and execute() disagree on the rows that sample")
        sampled = self.sampler(logits, sample_rows, self.token_counts)
        for j, i in enumerate(sampling):
            result.token_ids[i] = sampled.token_ids[j]
            result.logprobs[i] = sampled.logprobs[j]
        return result

    def _prompt_logprobs(
        self, s: ScheduledRequest, hidden: torch.Tensor, row_start: int
    ) -> list[TokenLogprob]:
        """Logprobs of the prompt tokens that this chunk's positions predict (position p
        predicts token p + 1), past those the request recorded (a recompute adds none), in
        slices of logits rows. `row_start`: the chunk's first row in `hidden`."""
        r = s.request
        start = r.num_computed_tokens
        first = max(start, len(r.prompt_logprobs) - 1)  # positions before are recorded
        end = min(start + s.num_new_tokens, len(r.prompt_token_ids) - 1)
        num_top = r.sampling_params.prompt_logprobs or 0
        out: list[TokenLogprob] = []
        for lo in range(first, end, PROMPT_LOGPROBS_ROWS):
            hi = min(lo + PROMPT_LOGPROBS_ROWS, end)
            rows = hidden[row_start + lo - start : row_start + hi - start]
            logprobs = self.model.compute_logits(rows).float().log_softmax(dim=-1)
            targets = torch.tensor(r.prompt_token_ids[lo + 1 : hi + 1], device=self.device)
            out += top_logprobs(logprobs, targets, [num_top] * (hi - lo))
        return out

    def _sampling_row(self, request: Request) -> SamplingRow:
        params = request.sampling_params
        check_token_ids("stop_token_ids", params.stop_token_ids, self.vocab_size)
        if params.logit_bias:
            check_token_ids("logit_bias", params.logit_bias, self.vocab_size)
        generator = None
        if params.seed is not None and not params.is_greedy:
            generator = self._generators.get(request.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
                # one draw per token so far: after a roll-back it resumes where it was
                self.sampler.skip_draws(generator, request.num_output_tokens, self.num_logits)
                self._generators[request.request_id] = generator
        banned: list[int] = []
        if request.num_output_tokens < params.min_tokens:
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                # an EOS id the model cannot produce needs no ban
                banned += [t for t in request.eos_token_ids if t < self.num_logits]
        penalty_row = self.token_counts.row(request) if params.has_penalties else -1
        return SamplingRow(params, generator, banned, penalty_row)


def _check_new_prompt_ids(s: ScheduledRequest, vocab_size: int) -> None:
    """The prompt tokens this step computes are in the vocabulary (sampled ones always are)."""
    r = s.request
    start, num_prompt = r.num_computed_tokens, len(r.prompt_token_ids)
    if start < num_prompt:
        ids = r.prompt_token_ids[start : min(start + s.num_new_tokens, num_prompt)]
        if min(ids) < 0 or max(ids) >= vocab_size:
            check_token_ids("prompt", ids, vocab_size)
