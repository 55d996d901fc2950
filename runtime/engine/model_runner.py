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

import torch

from kubeinfer.runtime.engine.batch import BlockTableArray, build_step_batch
from kubeinfer.runtime.engine.config import EngineConfig
from kubeinfer.runtime.engine.guided import GrammarMatchers
from kubeinfer.runtime.engine.model_shard import PROMPT_LOGPROBS_ROWS, ModelShard
from kubeinfer.runtime.engine.outputs import TokenLogprob
from kubeinfer.runtime.engine.penalties import TokenCounts
from kubeinfer.runtime.engine.request import Request
from kubeinfer.runtime.engine.runner_output import RunnerOutput
from kubeinfer.runtime.engine.sampler import Sampler, SamplingRow, top_logprobs
from kubeinfer.runtime.engine.sched_output import ScheduledRequest, SchedulerOutput
from kubeinfer.runtime.engine.tp_workers import RankFailure, TPWorkers
from kubeinfer.runtime.engine.validation import check_token_ids
from kubeinfer.runtime.loader import ProgressCallback
from kubeinfer.runtime.models import ModelConfig
from kubeinfer.runtime.models.parallel import SINGLE, check_tp_size

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
        self.workers: TPWorkers | None = None
        if config.tensor_parallel_size > 1:
            check_tp_size(ModelConfig.from_dir(model_dir), config.tensor_parallel_size)
            self.workers = TPWorkers(model_dir, config, dtype, self.device)
        try:
            tp = self.workers.group if self.workers is not None else SINGLE
            self.shard = ModelShard(model_dir, config, dtype, self.device, on_progress, tp)
            if self.workers is not None:
                self.workers.wait_loaded()
                num_blocks = config.num_kv_blocks or self.workers.size_kv(
                    self.shard.blocks_from_memory
                )
                self.workers.allocate_kv(num_blocks)
            else:
                num_blocks = config.num_kv_blocks or self.shard.blocks_from_memory()
            self.shard.allocate_kv(num_blocks)
        except BaseException:
            self.close(polite=False)
            raise
        model = self.model = self.shard.model
        self.ops = self.shard.ops
        self.max_model_len = self.shard.max_model_len
        self.vocab_size = model.config.vocab_size
        self.num_logits = self.vocab_size  # the sampler's row width (every rank's, gathered)
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.block_tables = BlockTableArray(
            config.max_num_seqs, -(-self.max_model_len // self.block_size)
        )
        self.sampler = Sampler(self.device, config.seed)
        self.token_counts = TokenCounts(self.num_logits, self.device)  # penalties' state
        self._generators: dict[str, torch.Generator] = {}
        self.grammar_matchers = GrammarMatchers(self.num_logits)  # guided requests' state
        logger.info(
            "KV cache: %d blocks of %d tokens (%.0f MiB%s)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.shard.bytes_per_block / 2**20,
            f" per rank, {config.tensor_parallel_size} ranks" if self.workers else "",
        )

    @property
    def fault(self) -> BaseException | None:
        """A fault of the replica found outside a step (a tensor-parallel rank that exited)."""
        return self.workers.fault if self.workers is not None else None

    def close(self, polite: bool = True) -> None:
        """Stop the tensor-parallel workers (nothing to do with one rank)."""
        if self.workers is not None:
            self.workers.close(polite)

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
        the logprobs the requests ask for. `rows` come from `prepare` for the same step.

        Under tensor parallelism the workers get the batch and the logits slices first, and
        every rank makes the same model calls in the same order (ModelShard.run_step); any
        error in them is a RankFailure (fatal: the ranks are out of step)."""
        batch = build_step_batch(out, block_ids, self.block_size, self.block_tables)
        # (request index, prompt positions [lo, hi), their rows [row_lo, row_hi) of hidden)
        plp: list[tuple[int, int, int, int, int]] = []
        for i, s in enumerate(out.scheduled):
            if s.request.needs_prompt_logprobs:
                offset = int(batch.query_start_loc[i]) - s.request.num_computed_tokens
                plp += [(i, lo, hi, offset + lo, offset + hi) for lo, hi in _prompt_ranges(s)]
        sampling = batch.sample_rows
        try:
            if self.workers is not None:
                self.workers.send(("step", batch, [(a, b) for *_, a, b in plp]))
            hidden = self.shard.forward(batch)
            logits = self.shard.sample_logits(hidden, batch) if sampling else None
            # a list for each request that asks (empty when no prompt position is left)
            prompt_logprobs: dict[int, list[TokenLogprob]] = {
                i: [] for i, s in enumerate(out.scheduled) if s.request.needs_prompt_logprobs
            }
            for i, lo, hi, a, b in plp:  # one slice's logits alive at a time
                r = out.scheduled[i].request
                prompt_logprobs[i] += self._slice_logprobs(r, hidden[a:b], lo, hi)
        except Exception as e:
            if self.workers is None:
                raise
            self.workers.check(wait_s=1.0)  # a rank that exited: its fault names it
            raise RankFailure(f"tensor-parallel step failed: {type(e).__name__}: {e}") from e
        num_scheduled = len(out.scheduled)
        result = RunnerOutput([None] * num_scheduled, [None] * num_scheduled, prompt_logprobs)
        if not sampling:
            return result
        assert logits is not None
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

    def _slice_logprobs(
        self, r: Request, rows: torch.Tensor, lo: int, hi: int
    ) -> list[TokenLogprob]:
        """Logprobs of prompt tokens lo + 1 .. hi from the hidden rows of positions lo .. hi - 1
        (their logits: on every rank at once under tensor parallelism, gathered on rank 0)."""
        logits = self.model.compute_logits(rows)
        if logits is None:
            raise RankFailure("rank 0 got no gathered logits")
        targets = torch.tensor(r.prompt_token_ids[lo + 1 : hi + 1], device=self.device)
        num_top = r.sampling_params.prompt_logprobs or 0
        return top_logprobs(logits.float().log_softmax(dim=-1), targets, [num_top] * (hi - lo))

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


def _prompt_ranges(s: ScheduledRequest) -> list[tuple[int, int]]:
    """The prompt positions `[lo, hi)` whose logprobs this chunk computes, in slices of
    PROMPT_LOGPROBS_ROWS: those its positions predict (position p predicts token p + 1), past
    those the request recorded (a recompute adds none)."""
    r = s.request
    start = r.num_computed_tokens
    first = max(start, len(r.prompt_logprobs) - 1)  # positions before are recorded
    end = min(start + s.num_new_tokens, len(r.prompt_token_ids) - 1)
    return [
        (lo, min(lo + PROMPT_LOGPROBS_ROWS, end)) for lo in range(first, end, PROMPT_LOGPROBS_ROWS)
    ]


def _check_new_prompt_ids(s: ScheduledRequest, vocab_size: int) -> None:
    """The prompt tokens this step computes are in the vocabulary (sampled ones always are)."""
    r = s.request
    start, num_prompt = r.num_computed_tokens, len(r.prompt_token_ids)
    if start < num_prompt:
        ids = r.prompt_token_ids[start : min(start + s.num_new_tokens, num_prompt)]
        if min(ids) < 0 or max(ids) >= vocab_size:
            check_token_ids("prompt", ids, vocab_size)
