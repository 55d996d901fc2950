"""Penalties: presence, frequency and repetition, over per-request token counts on the device.

The formulas are vLLM's (after OpenAI's parameter details), for each row and token t:

    logits[t] /= r  if logits[t] > 0 else  logits[t] *= r   (t in the prompt or the output)
    logits[t] -= frequency * count[t] + presence * (count[t] > 0)   (count: in the output)

`TokenCounts` keeps a row per running request with penalties: how often each token is in its
output and, with a repetition penalty, which tokens are in its prompt. A row is a function of
the request's tokens, never a log of events: `row()` counts the tokens recorded since it last
looked (one per decode step), queued and added in one batched op per step (`flush`), and
rebuilds the row when it counted more than the request holds. Rows are released when the request
finishes or is preempted (the model runner calls `release`), and rebuilt from its tokens when it
runs again; the buffers grow by doubling, so only a batch that uses penalties pays for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubeinfer.runtime.engine.request import Request

_INITIAL_ROWS = 8


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor | None,
) -> None:
    """Penalize `logits` (S, V) float32 in place, at rows `rows` (P,). output_counts (P, V)
    int; prompt_mask (P, V) bool or None (no prompt tokens penalized); presence, frequency and
    repetition (P,) float32, repetition None when every row's is 1.

    Only the tokens a row has seen change, so the work past finding them (one compare and one
    `nonzero` over (P, V)) is on those few (row, token) pairs: a dense formula would take about
    ten passes over (P, V), several of them broadcasting `where`s that cost 10x a plain pass on
    CPU (measured: 35-65 ms against 6 ms at P = 64, V = 49152, one thread)."""
    if repetition is not None:
        seen = output_counts > 0
        if prompt_mask is not None:
            seen |= prompt_mask
        seen_rows, seen_ids = seen.nonzero(as_tuple=True)
        at = (rows[seen_rows], seen_ids)
        values = logits[at]
        r = repetition[seen_rows]
        logits[at] = torch.where(values > 0, values / r, values * r)
    out_rows, out_ids = output_counts.nonzero(as_tuple=True)
    counts = output_counts[out_rows, out_ids].to(logits.dtype)
    at = (rows[out_rows], out_ids)
    logits[at] -= frequency[out_rows] * counts + presence[out_rows]


@dataclass(slots=True)
class _Row:
    index: int
    num_counted: int = 0
    """Output tokens counted (queued or added)."""


class TokenCounts:
    def __init__(self, num_logits: int, device: torch.device) -> None:
        self.num_logits = num_logits
        self.device = device
        self.output_counts = torch.zeros(0, num_logits, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(0, num_logits, dtype=torch.bool, device=device)
        self._rows: dict[str, _Row] = {}
        self._free: list[int] = []
        self._pending_rows: list[int] = []
        self._pending_ids: list[int] = []

    @property
    def num_rows(self) -> int:
        """Rows held by requests now."""
        return len(self._rows)

    def row(self, request: Request) -> int:
        """The request's row, counting its output tokens not counted yet (queued for `flush`)."""
        entry = self._rows.get(request.request_id)
        output = request.output_token_ids
        if entry is None:
            entry = self._rows[request.request_id] = _Row(self._take_row())
            self._reset(entry, request)
        elif entry.num_counted > len(output):  # counted a token that was never recorded
            self._reset(entry, request)
        if entry.num_counted < len(output):
            new = output[entry.num_counted :]
            self._pending_rows += [entry.index] * len(new)
            self._pending_ids += new
            entry.num_counted = len(output)
        return entry.index

    def release(self, request_id: str) -> None:
        entry = self._rows.pop(request_id, None)
        if entry is not None:
            self._drop_pending(entry.index)
            self._free.append(entry.index)

    def flush(self) -> None:
        """Add the queued tokens to their rows (one op for the whole step)."""
        if not self._pending_rows:
            return
        rows = torch.tensor(self._pending_rows, device=self.device)
        ids = torch.tensor(self._pending_ids, device=self.device)
        self.output_counts.index_put_(
            (rows, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True
        )
        self._pending_rows, self._pending_ids = [], []

    # internals

    def _take_row(self) -> int:
        if not self._free:
            old = self.output_counts.shape[0]
            new = max(2 * old, _INITIAL_ROWS)
            self.output_counts = _grow(self.output_counts, new)
            self.prompt_mask = _grow(self.prompt_mask, new)
            self._free = list(range(new - 1, old - 1, -1))
        return self._free.pop()

    def _reset(self, entry: _Row, request: Request) -> None:
        self._drop_pending(entry.index)
        self.output_counts[entry.index].zero_()
        mask = self.prompt_mask[entry.index]
        mask.zero_()
        if request.sampling_params.repetition_penalty != 1.0:
            ids = torch.tensor(request.prompt_token_ids, device=self.device)
            mask[ids] = True
        entry.num_counted = 0

    def _drop_pending(self, index: int) -> None:
        if index in self._pending_rows:
            pending = zip(self._pending_rows, self._pending_ids, strict=True)
            kept = [(r, t) for r, t in pending if r != index]
            self._pending_rows = [r for r, _ in kept]
            self._pending_ids = [t for _, t in kept]


def _grow(buffer: torch.Tensor, num_rows: int) -> torch.Tensor:
    out = torch.zeros(num_rows, buffer.shape[1], dtype=buffer.dtype, device=buffer.device)
    out[: buffer.shape[0]] = buffer
    return out
