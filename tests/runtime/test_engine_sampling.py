"""logprobs, penalties and n > 1 through the real engine, against transformers (tiny models).

- logprobs (sampled and prompt tokens) equal a float32 log-softmax of transformers' logits,
  under batching, chunked prefill and preemption;
- penalties: greedy tokens equal a step-by-step reference (transformers' logits, vLLM's
  formulas), also when the request is preempted and recomputed;
- n > 1: the sequences share the prompt's full KV blocks (fewer blocks than n requests, counted
  on the KV cache), choice i draws as a request with seed + i, and nothing leaks after finish,
  abort or preemption.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kubeinfer.runtime import LLM, SamplingParams
from kubeinfer.runtime.engine.engine import Engine
from kubeinfer.runtime.engine.outputs import RequestOutput, TokenLogprob

from .test_sampler import penalized_reference

ATOL = 2e-4  # float32 on both sides; the kernels sum in another order than transformers


def hf_model(model_dir: Path):  # noqa: ANN201
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@torch.no_grad()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """(len(ids), V) float32 log-softmax of transformers' logits at every position."""
    return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def assert_logprob_matches(got: TokenLogprob, ref: torch.Tensor, token: int, k: int) -> None:
    assert got.token_id == token
    assert abs(got.logprob - ref[token].item()) < ATOL
    values, ids = ref.topk(k)
    assert len(got.top) == k
    for (tid, value), ref_id, ref_value in zip(got.top, ids.tolist(), values.tolist(), strict=True):
        # near-ties may swap places: the value must match the reference's at that rank, and
        # the token's own reference value must match too
        assert abs(value - ref_value) < ATOL
        assert abs(ref[tid].item() - value) < ATOL or tid == ref_id


def assert_output_logprobs(model, out: RequestOutput, k: int, prompt_k: int | None) -> None:  # noqa: ANN001
    completion = out.outputs[0]
    ids = out.prompt_token_ids + completion.token_ids
    ref = hf_logprobs(model, ids)
    n = len(out.prompt_token_ids)
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    for j, (token, got) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert_logprob_matches(got, ref[n - 1 + j], token, k)
    if prompt_k is None:
        assert out.prompt_logprobs is None
        return
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == n
    assert out.prompt_logprobs[0] is None
    for j in range(1, n):
        got = out.prompt_logprobs[j]
        assert got is not None
        assert_logprob_matches(got, ref[j - 1], out.prompt_token_ids[j], prompt_k)


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 384) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_whole(engine: Engine) -> None:
    kv = engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert not engine.has_unfinished and not engine._requests
    assert engine.runner.token_counts.num_rows == 0
    assert not engine.runner.block_tables._rows


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "mistral"])
def test_logprobs_match_transformers(tiny_models: dict[str, Path], name: str) -> None:
    llm = LLM(tiny_models[name], dtype="float32", num_kv_blocks=128)
    prompts = random_prompts([1, 9, 16, 17, 40])
    params = [
        SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=0, ignore_eos=True),
        SamplingParams(max_tokens=6, logprobs=20, prompt_logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=0),
        SamplingParams(temperature=0.7, max_tokens=6, logprobs=1, presence_penalty=1.5),
    ]
    model = hf_model(tiny_models[name])
    for out, p in zip(llm.generate(prompts, params), params, strict=True):
        assert_output_logprobs(model, out, p.logprobs or 0, p.prompt_logprobs)
    assert_whole(llm.engine)


def test_prompt_logprobs_under_chunked_prefill_preemption_and_prefix_hits(
    tiny_models: dict[str, Path],
) -> None:
    """A 150-token prompt in 32-token chunks, in a pool that preempts, after its own prefix was
    cached: every prompt position is computed (no hit skips one) and recorded exactly once."""
    model_dir = tiny_models["llama-gqa"]
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=14, max_num_batched_tokens=32)
    prompt = random_prompts([150], seed=4)[0]
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    wanted = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, logprobs=2, prompt_logprobs=4
    )
    llm.generate([prompt], plain)  # its prefix is cached now
    before = llm.engine.scheduler.num_preemptions
    outs = llm.generate([prompt, prompt[:100], prompt], [wanted, plain, wanted])
    assert llm.engine.scheduler.num_preemptions > before
    model = hf_model(model_dir)
    for out in (outs[0], outs[2]):
        assert_output_logprobs(model, out, 2, 4)
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert_whole(llm.engine)


@torch.no_grad()
def reference_penalized_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:  # noqa: ANN001
    from kubeinfer.runtime.engine.request import Request

    r = Request("ref", prompt, params)
    for _ in range(params.max_tokens):
        logits = model(torch.tensor([r.all_token_ids])).logits[0, -1].float()
        for token, bias in (params.logit_bias or {}).items():
            logits[token] += bias
        r.output_token_ids.append(int(penalized_reference(logits, r).argmax()))
    return r.output_token_ids


PENALTIES = [
    SamplingParams(presence_penalty=1.2),
    SamplingParams(frequency_penalty=0.8),
    SamplingParams(repetition_penalty=1.6),
    SamplingParams(repetition_penalty=0.6, presence_penalty=-0.5),
    SamplingParams(frequency_penalty=-1.0, logit_bias={7: 2.0, 300: -3.0}),
    SamplingParams(logit_bias={11: 1.5}),
]


def test_penalties_match_a_step_by_step_reference(tiny_models: dict[str, Path]) -> None:
    """Penalized requests beside plain ones in a pool that preempts (their token counts are
    rebuilt when they run again): every token as the reference picks it."""
    model_dir = tiny_models["llama-tied"]
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=16)
    prompts = random_prompts([12, 30, 5, 44, 20, 9, 25], seed=7)
    params = []
    for i in range(len(prompts)):
        p = PENALTIES[i % len(PENALTIES)] if i % 4 != 3 else SamplingParams()
        params.append(
            SamplingParams(
                temperature=0,
                max_tokens=16,
                ignore_eos=True,
                presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty,
                repetition_penalty=p.repetition_penalty,
                logit_bias=p.logit_bias,
            )
        )
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    model = hf_model(model_dir)
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert out.outputs[0].token_ids == reference_penalized_greedy(model, prompt, p)
    assert_whole(llm.engine)


# n > 1


def peak_blocks(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[int, list]:
    """The most KV blocks held during any step, and the outputs."""
    engine = llm.engine
    real = engine.runner.execute
    peak = 0

    def counting(out, block_ids, rows):  # noqa: ANN001, ANN202
        nonlocal peak
        peak = max(peak, engine.kv_cache.num_blocks - engine.kv_cache.num_free_blocks)
        return real(out, block_ids, rows)

    engine.runner.execute = counting  # type: ignore[method-assign]
    try:
        outs = llm.generate(prompts, params)
    finally:
        engine.runner.execute = real  # type: ignore[method-assign]
    return peak, outs


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n_shares_the_prompt_blocks(tiny_models: dict[str, Path], prefix_caching: bool) -> None:
    """A 100-token prompt, 20 tokens each: 4 separate requests hold 4 x 8 blocks (without
    prefix caching); n=4 holds the prompt's 6 full blocks once plus 2 blocks per sequence."""
    llm = LLM(
        tiny_models["llama-gqa"],
        dtype="float32",
        num_kv_blocks=64,
        enable_prefix_caching=prefix_caching,
    )
    prompt = random_prompts([100], seed=5)[0]
    one = SamplingParams(temperature=0.8, seed=10, max_tokens=20, ignore_eos=True)
    group = SamplingParams(temperature=0.8, seed=10, max_tokens=20, ignore_eos=True, n=4)
    separate_peak, _ = peak_blocks(llm, [prompt] * 4, one)
    llm.engine.kv_cache.reset_prefix_cache()
    n_peak, (out,) = peak_blocks(llm, [prompt], group)
    assert n_peak == 6 + 4 * 2
    # with prefix caching, separate requests arriving together share the full blocks too
    assert separate_peak == (6 + 4 * 2 if prefix_caching else 4 * 8)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    # choice i draws exactly as a request with seed + i
    for i, choice in enumerate(out.outputs):
        alone = llm.generate([prompt], SamplingParams(
            temperature=0.8, seed=10 + i, max_tokens=20, ignore_eos=True
        ))[0]
        assert choice.token_ids == alone.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    assert_whole(llm.engine)


def test_n_unseeded_choices_differ_and_greedy_ones_agree(tiny_models: dict[str, Path]) -> None:
    llm = LLM(tiny_models["llama-gqa"], dtype="float32", num_kv_blocks=64)
    prompt = random_prompts([37], seed=6)[0]
    (out,) = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=12, n=3))
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (one,) = llm.generate([prompt], greedy)
    (many,) = llm.generate([prompt], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, n=5, logprobs=1
    ))
    for c in many.outputs:
        assert c.token_ids == one.outputs[0].token_ids and c.logprobs is not None
    assert_whole(llm.engine)


def test_n_leaks_nothing_after_preemption_and_abort(tiny_models: dict[str, Path]) -> None:
    """n=4 of a 40-token prompt in 12 blocks: the sequences preempt one another (and the
    first, whose blocks the others share) and still give the tokens they give alone; aborting
    a group mid-way frees every block."""
    llm = LLM(tiny_models["llama-gqa"], dtype="float32", num_kv_blocks=12)
    engine = llm.engine
    prompt = random_prompts([40], seed=8)[0]
    params = SamplingParams(
        temperature=0.9, seed=1, max_tokens=40, ignore_eos=True, n=4, frequency_penalty=0.5
    )
    before = engine.scheduler.num_preemptions
    (out,) = llm.generate([prompt], params)
    assert engine.scheduler.num_preemptions > before
    assert_whole(engine)
    for i, choice in enumerate(out.outputs):
        alone = SamplingParams(
            temperature=0.9, seed=1 + i, max_tokens=40, ignore_eos=True, frequency_penalty=0.5
        )
        assert choice.token_ids == llm.generate([prompt], alone)[0].outputs[0].token_ids
    requests = engine.make_requests(prompt, params)
    for r in requests:
        engine.add(r)
    for _ in range(5):
        engine.step()
    assert engine.kv_cache.num_free_blocks < engine.kv_cache.num_blocks
    for r in requests:
        assert engine.abort(r.request_id) is not None
    assert_whole(engine)


def test_make_request_refuses_n_and_names_it(tiny_models: dict[str, Path]) -> None:
    engine = LLM(tiny_models["llama-gqa"], dtype="float32", num_kv_blocks=16).engine
    with pytest.raises(ValueError, match="make_requests") as e:
        engine.make_request([1, 2], SamplingParams(n=2))
    assert e.value.param == "n"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="logit_bias: token id 384") as e:
        engine.make_requests([1, 2], SamplingParams(logit_bias={384: 1.0}))
    assert e.value.param == "logit_bias"  # type: ignore[attr-defined]
