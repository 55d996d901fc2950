"""The batched sampler alone: penalties, logit_bias and logprobs against plain per-row
references, rows that use none of them untouched, and the token-count rows' bookkeeping."""

from __future__ import annotations

import math

import pytest
import torch

from kubeinfer.runtime.engine.penalties import TokenCounts, apply_penalties
from kubeinfer.runtime.engine.request import Request
from kubeinfer.runtime.engine.sampler import Sampler, SamplingRow, first_argmax
from kubeinfer.runtime.engine.sampling_params import SamplingParams

VOCAB = 97
CPU = torch.device("cpu")


def request(rid: str, prompt: list[int], output: list[int], params: SamplingParams) -> Request:
    r = Request(rid, prompt, params)
    r.output_token_ids = list(output)
    return r


def penalized_reference(logits: torch.Tensor, r: Request) -> torch.Tensor:
    """One row, one token at a time, as vLLM's docs state the formulas."""
    p = r.sampling_params
    out = logits.clone()
    seen = set(r.prompt_token_ids) | set(r.output_token_ids)
    for t in range(out.shape[0]):
        if t in seen and p.repetition_penalty != 1.0:
            v = out[t].item()
            out[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        count = r.output_token_ids.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_first_argmax_is_argmax() -> None:
    x = torch.randn(7, VOCAB)
    x[3, 5] = x[3, 9] = x[3].max() + 1  # ties: the first
    assert torch.equal(first_argmax(x), x.argmax(-1))


def test_penalties_match_the_per_row_reference() -> None:
    g = torch.Generator().manual_seed(0)
    counts = TokenCounts(VOCAB, CPU)
    requests = [
        request("a", [1, 2, 3, 3], [4, 4, 5], SamplingParams(presence_penalty=0.5)),
        request("b", [9, 10], [9, 11, 11, 11], SamplingParams(frequency_penalty=-0.7)),
        request("c", [20, 21], [22, 20], SamplingParams(repetition_penalty=1.8)),
        request(
            "d",
            [30],
            [31, 31, 30, 40],
            SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.3),
        ),
    ]
    logits = torch.randn(len(requests), VOCAB, generator=g) * 3
    rows = [counts.row(r) for r in requests]
    counts.flush()
    r_t = torch.tensor(rows)
    reps = [r.sampling_params.repetition_penalty for r in requests]
    got = logits.clone()
    apply_penalties(
        got,
        torch.arange(len(requests)),
        counts.output_counts[r_t],
        counts.prompt_mask[r_t],
        torch.tensor([r.sampling_params.presence_penalty for r in requests]),
        torch.tensor([r.sampling_params.frequency_penalty for r in requests]),
        torch.tensor(reps),
    )
    for i, r in enumerate(requests):
        torch.testing.assert_close(got[i], penalized_reference(logits[i], r))


def test_penalized_greedy_rows_beside_plain_rows() -> None:
    """In one batch: penalized rows take the argmax of the penalized logits, and rows without
    penalties, biases or logprobs get exactly what they get alone."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, VOCAB, generator=g)
    plain = SamplingParams(temperature=0)
    pen = SamplingParams(temperature=0, frequency_penalty=2.0, repetition_penalty=1.5)
    requests = [
        request(f"r{i}", [int(logits[i].argmax())], [int(logits[i].argmax())] * 3, pen)
        for i in range(6)
    ]
    counts = TokenCounts(VOCAB, CPU)
    rows = [
        SamplingRow(pen if i % 2 else plain, None, (), counts.row(r) if i % 2 else -1)
        for i, r in enumerate(requests)
    ]
    out = Sampler(CPU, seed=0)(logits.clone(), rows, counts)
    for i, r in enumerate(requests):
        expected = penalized_reference(logits[i], r) if i % 2 else logits[i]
        assert out.token_ids[i] == int(expected.argmax())
        if i % 2:  # the penalty moved it off the raw argmax
            assert out.token_ids[i] != int(logits[i].argmax())
    assert out.logprobs == [None] * 6
    alone = Sampler(CPU, seed=0)(logits[::2].clone(), [SamplingRow(plain, None)] * 3)
    assert alone.token_ids == out.token_ids[::2]


def test_logit_bias_and_bans_in_a_batch() -> None:
    logits = torch.zeros(3, VOCAB)
    rows = [
        SamplingRow(SamplingParams(temperature=0, logit_bias={42: 5.0, 7: -100.0}), None),
        SamplingRow(SamplingParams(temperature=0, logit_bias={0: -100.0}), None, [1]),
        SamplingRow(SamplingParams(temperature=0), None),
    ]
    out = Sampler(CPU)(logits, rows)
    assert out.token_ids == [42, 2, 0]


def test_seeded_random_row_with_penalties_is_batch_independent() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, VOCAB, generator=g)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, presence_penalty=1.0)
    r = request("x", [3, 4], [5, 6, 6], params)

    def draw(batch_logits: torch.Tensor, at: int) -> int:
        counts = TokenCounts(VOCAB, CPU)
        rows = [SamplingRow(SamplingParams(temperature=1.0), None) for _ in batch_logits]
        rows[at] = SamplingRow(params, torch.Generator().manual_seed(11), (), counts.row(r))
        return Sampler(CPU, seed=at)(batch_logits.clone(), rows, counts).token_ids[at]

    assert draw(logits[2:3], 0) == draw(logits, 2)


def test_logprobs_are_the_raw_log_softmax() -> None:
    """Taken before bias, penalties and temperature (vLLM's raw logprobs), for the rows that
    ask; the sampled token's, and the top-k in order."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, VOCAB, generator=g).to(torch.bfloat16)
    raw = logits.float().log_softmax(-1)
    counts = TokenCounts(VOCAB, CPU)
    r = request("p", [1], [2, 2], SamplingParams(frequency_penalty=2))
    rows = [
        SamplingRow(SamplingParams(temperature=0, logprobs=5, logit_bias={9: 100.0}), None),
        SamplingRow(SamplingParams(temperature=0.5, seed=1), torch.Generator().manual_seed(1)),
        SamplingRow(
            SamplingParams(temperature=2.0, logprobs=0, frequency_penalty=2),
            None,
            (),
            counts.row(r),
        ),
    ]
    out = Sampler(CPU, seed=0)(logits, rows, counts)
    assert out.token_ids[0] == 9 and out.logprobs[1] is None
    first = out.logprobs[0]
    assert first is not None and first.token_id == 9
    assert math.isclose(first.logprob, raw[0, 9].item(), rel_tol=1e-6)
    values, ids = raw[0].topk(5)
    assert [t for t, _ in first.top] == ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(values.tolist(), rel=1e-6)
    third = out.logprobs[2]
    assert third is not None and third.top == []
    assert third.token_id == out.token_ids[2]
    assert math.isclose(third.logprob, raw[2, out.token_ids[2]].item(), rel_tol=1e-6)


def test_token_counts_follow_the_request() -> None:
    """A row counts the tokens recorded since it last looked; a row that counted more than the
    request holds (a failed step) is rebuilt; released rows are reused, zeroed."""
    counts = TokenCounts(VOCAB, CPU)
    params = SamplingParams(repetition_penalty=1.2)
    r = request("a", [7, 8], [1], params)
    row = counts.row(r)
    r.output_token_ids += [2, 2]
    assert counts.row(r) == row
    counts.flush()
    assert counts.output_counts[row, [1, 2]].tolist() == [1, 2]
    assert counts.prompt_mask[row].nonzero().flatten().tolist() == [7, 8]
    r.output_token_ids.pop()  # as if the step that counted it had failed
    counts.row(r)
    counts.flush()
    assert counts.output_counts[row].sum().item() == 2
    counts.release("a")
    other = request("b", [9], [], SamplingParams(presence_penalty=1))
    assert counts.row(other) == row and counts.num_rows == 1
    counts.flush()
    assert counts.output_counts[row].sum().item() == 0
    assert not counts.prompt_mask[row].any()  # no repetition penalty: no prompt mask


def test_token_counts_grow_and_drop_pending_of_released_rows() -> None:
    counts = TokenCounts(VOCAB, CPU)
    params = SamplingParams(presence_penalty=1)
    requests = [request(f"r{i}", [1], [i % VOCAB, 3], params) for i in range(20)]
    rows = [counts.row(r) for r in requests]
    assert len(set(rows)) == 20 and counts.output_counts.shape[0] >= 20
    counts.release("r5")  # its queued tokens must not land in the row's next owner
    newcomer = request("new", [1], [], SamplingParams(presence_penalty=1))
    assert counts.row(newcomer) == rows[5]
    counts.flush()
    assert counts.output_counts[rows[5]].sum().item() == 0
    assert counts.output_counts[rows[6], 3].item() == 1
