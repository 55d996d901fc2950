"""StepBatch: one step's requests flattened into the varlen layout the kernels consume.

Built from plain lists (no torch, no per-request numpy calls): at 256 decoding requests this is
on the scheduler's per-step budget, so it stays a tight Python loop, measured by
`bench/scheduler.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kubeinfer.runtime.engine.sched_output import SchedulerOutput


@dataclass(slots=True)
class StepBatch:
    input_ids: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64
    slot_mapping: np.ndarray  # (T,) int64: block_id * block_size + offset
    block_tables: np.ndarray  # (S, max_blocks) int32, padded with -1
    seq_lens: np.ndarray  # (S,) int32, tokens including this step's
    query_start_loc: np.ndarray  # (S + 1,) int32
    sample_rows: list[int]  # the sequences whose last token is sampled
    logits_indices: list[int]  # their last token's index in the flat batch


class BlockTableArray:
    """Block tables kept in one persistent (max_num_seqs, max_blocks) array, a row per running
    request, updated in place as blocks are appended; a step gathers its rows in one indexing
    call instead of converting every table again."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.table = np.full((max_num_seqs, max_blocks_per_seq), -1, dtype=np.int32)
        self._rows: dict[str, int] = {}
        self._lists: list[list[int] | None] = [None] * max_num_seqs
        self._lens = [0] * max_num_seqs
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def row(self, request_id: str, block_ids: list[int]) -> int:
        row = self._rows.get(request_id)
        if row is None:
            row = self._rows[request_id] = self._free_rows.pop()
        n = len(block_ids)
        if self._lists[row] is not block_ids:  # new request, or re-allocated after preemption
            self._lists[row] = block_ids
            self.table[row, :n] = block_ids
            self.table[row, n:] = -1
        elif n > self._lens[row]:
            self.table[row, self._lens[row] : n] = block_ids[self._lens[row] :]
        self._lens[row] = n
        return row

    def release(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._lists[row] = None
            self._lens[row] = 0
            self._free_rows.append(row)


def build_step_batch(
    out: SchedulerOutput,
    block_ids: Callable[[str], list[int]],
    block_size: int,
    tables: BlockTableArray,
) -> StepBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    rows: list[int] = []
    width = 0
    sample_rows: list[int] = []
    logits_indices: list[int] = []
    bs = block_size
    table_row = tables.row
    for i, s in enumerate(out.scheduled):
        r = s.request
        table = block_ids(r.request_id)
        start = r.num_computed_tokens
        end = start + s.num_new_tokens
        num_tokens = len(r.prompt_token_ids) + len(r.output_token_ids)
        if end - start == 1:  # a decode: skip the range machinery
            if r.output_token_ids and start == num_tokens - 1:
                input_ids.append(r.output_token_ids[-1])
            else:
                input_ids += r.token_slice(start, end)
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            input_ids += r.token_slice(start, end)
            rng = range(start, end)
            positions += rng
            slots += [table[p // bs] * bs + p % bs for p in rng]
        seq_lens.append(end)
        query_start_loc.append(query_start_loc[-1] + end - start)
        rows.append(table_row(r.request_id, table))
        if len(table) > width:
            width = len(table)
        if end == num_tokens:
            sample_rows.append(i)
            logits_indices.append(query_start_loc[-1] - 1)
    block_tables = tables.table[rows, :width]
    return StepBatch(
        np.array(input_ids, dtype=np.int64),
        np.array(positions, dtype=np.int64),
        np.array(slots, dtype=np.int64),
        block_tables,
        np.array(seq_lens, dtype=np.int32),
        np.array(query_start_loc, dtype=np.int32),
        sample_rows,
        logits_indices,
    )
