"""Sampling, stopping, aborts and validation through the real engine (tiny model or SmolLM2)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kubeinfer.runtime import LLM, SamplingParams
from kubeinfer.runtime.engine.async_engine import AsyncEngine
from kubeinfer.runtime.engine.engine import Engine


@pytest.fixture(scope="module")
def tiny_llm(tiny_models: dict[str, Path]) -> LLM:
    return LLM(tiny_models["llama-gqa"], dtype="float32", num_kv_blocks=256)


@pytest.fixture(scope="module")
def smol_llm(smollm2_dir: Path) -> LLM:
    return LLM(smollm2_dir, dtype="float32", num_kv_blocks=512)


def assert_pool_whole(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert not llm.engine.has_unfinished


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 384, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_llm: LLM) -> None:
    target = [11, 22, 33, 44, 55]
    params = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True
    )
    alone = tiny_llm.generate([target], params)[0].outputs[0].token_ids
    others = prompts(16, seed=5)
    other_params = [
        SamplingParams(
            temperature=1.0, max_tokens=int(8 + i), seed=i if i % 2 else None, ignore_eos=True
        )
        for i in range(16)
    ]
    batch = tiny_llm.generate(
        [*others[:7], target, *others[7:]], [*other_params[:7], params, *other_params[7:]]
    )
    assert batch[7].outputs[0].token_ids == alone
    assert len(set(map(tuple, [o.outputs[0].token_ids for o in batch]))) > 1
    assert_pool_whole(tiny_llm)


def test_unseeded_sampling_varies(tiny_llm: LLM) -> None:
    params = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    outs = tiny_llm.generate([[5, 6, 7]] * 4, params)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=0.7, top_p=1e-6),
        SamplingParams(temperature=0.7, min_p=1.0),
    ],
    ids=["top_k=1", "top_p~0", "min_p=1"],
)
def test_filters_that_leave_one_token_are_greedy(tiny_llm: LLM, params: SamplingParams) -> None:
    params.max_tokens, params.ignore_eos = 12, True
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    p = prompts(3, seed=9)
    assert [o.outputs[0].token_ids for o in tiny_llm.generate(p, params)] == [
        o.outputs[0].token_ids for o in tiny_llm.generate(p, greedy)
    ]


def test_max_tokens_gives_length(tiny_llm: LLM) -> None:
    out = tiny_llm.generate(
        [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    assert out.prompt_token_ids == [1, 2, 3]


def test_stop_token_ids_and_min_tokens(tiny_llm: LLM) -> None:
    free = tiny_llm.generate(
        [[9, 8, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )[0].outputs[0]
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    out = tiny_llm.generate(
        [[9, 8, 7]],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at]),
    )[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens bans the stop token until enough tokens exist
    late = tiny_llm.generate(
        [[9, 8, 7]],
        SamplingParams(
            temperature=0,
            max_tokens=20,
            ignore_eos=True,
            stop_token_ids=[stop_at],
            min_tokens=first + 2,
        ),
    )[0].outputs[0]
    assert len(late.token_ids) >= first + 2
    assert stop_at not in late.token_ids[: first + 2]


def test_eos_stops_unless_ignored(smol_llm: LLM) -> None:
    chat = smol_llm.tokenizer.encode_chat([{"role": "user", "content": "Say hi."}])
    out = smol_llm.generate([chat], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2 and "<|im_end|>" not in out.text
    long = smol_llm.generate(
        [chat], SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 5, ignore_eos=True)
    )[0].outputs[0]
    assert long.finish_reason == "length" and long.token_ids[: len(out.token_ids)] == out.token_ids


def test_stop_string_is_not_emitted(smol_llm: LLM) -> None:
    chat = smol_llm.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    free = smol_llm.generate([chat], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert "Paris" in free.text
    out = smol_llm.generate([chat], SamplingParams(temperature=0, max_tokens=24, stop=["Paris"]))[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert out.text == free.text[: free.text.index("Paris")]
    assert_pool_whole(smol_llm)


def test_text_prompts_and_input_order(smol_llm: LLM) -> None:
    texts = ["The capital of France is", "1, 2, 3, 4,", "Hello"]
    outs = smol_llm.generate(texts, SamplingParams(temperature=0, max_tokens=6))
    assert [o.prompt for o in outs] == texts
    assert "5" in outs[1].outputs[0].text


def test_abort_mid_generation_frees_blocks(tiny_llm: LLM) -> None:
    engine: Engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts(12, seed=3)]
    for _ in range(5):
        engine.step()
    for rid in ids[::2]:
        out = engine.abort(rid)
        assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    while engine.has_unfinished:
        engine.step()
    assert engine.abort("no-such-request") is None
    assert_pool_whole(tiny_llm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_invalid_requests(tiny_llm: LLM, tiny_models: dict[str, Path]) -> None:
    engine = tiny_llm.engine
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([1, 10**6])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([1] * engine.max_model_len)
    small = LLM(tiny_models["llama-gqa"], dtype="float32", num_kv_blocks=8).engine
    with pytest.raises(ValueError, match=r"needs 202 tokens of KV cache; the pool holds 128"):
        small.add_request([1, 2], SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("text needs a tokenizer")
    with pytest.raises(ValueError, match="sampling params for"):
        tiny_llm.generate([[1], [2]], [SamplingParams()] * 3)
    assert_pool_whole(tiny_llm)


def test_unknown_engine_arg_is_rejected(tiny_models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="num_kv_blockz"):
        LLM(tiny_models["llama-gqa"], num_kv_blockz=3)


def test_the_step_budget_defaults_to_vllms_cpu_one(tiny_llm: LLM) -> None:
    """Unset, a CPU engine's step budget is vLLM's offline CPU default (4096), not the GPU's."""
    assert tiny_llm.engine.config.max_num_batched_tokens == 4096
    assert tiny_llm.engine.scheduler.max_num_batched_tokens == 4096


def test_async_engine_streams_and_cancels(smol_llm: LLM) -> None:
    engine = AsyncEngine(smol_llm.engine)
    engine.start()
    chat = smol_llm.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )

    async def full() -> tuple[str, str, list[int]]:
        text, ids, final = "", [], None
        async for out in engine.generate(chat, SamplingParams(temperature=0, max_tokens=24)):
            text += out.outputs[0].new_text
            ids += out.outputs[0].new_token_ids
            final = out
        assert final is not None and final.finished
        return text, final.outputs[0].text, ids

    async def cancelled() -> None:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        n = 0
        async for _ in engine.generate(chat, params):
            n += 1
            if n == 3:
                break  # the client went away

    async def main() -> None:
        results = await asyncio.gather(full(), *[cancelled() for _ in range(4)], full())
        streamed, final_text, ids = results[0]
        assert streamed == final_text and "Paris" in streamed and ids[-1] == 2
        assert results[-1] == results[0]
        for _ in range(100):
            if not smol_llm.engine.has_unfinished:
                break
            await asyncio.sleep(0.05)

    try:
        asyncio.run(main())
        assert engine.num_unfinished == 0
        assert_pool_whole(smol_llm)
        with pytest.raises(ValueError, match="empty"):
            asyncio.run(anext(engine.generate([])))  # type: ignore[arg-type]
    finally:
        engine.stop()


def test_first_argmax_is_argmax_with_its_ties_and_nans() -> None:
    import torch

    from kubeinfer.runtime.engine.sampler import first_argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (64, 300), generator=g).float()  # many ties: the first index wins
    x[3, 7] = x[5, 0] = float("nan")
    x[9] = float("-inf")
    for t in (x, x.bfloat16()):
        assert torch.equal(first_argmax(t), t.argmax(dim=-1))
