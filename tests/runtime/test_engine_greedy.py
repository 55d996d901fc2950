"""Greedy engine outputs equal transformers `generate` token for token, under every scheduling
regime: defaults, a KV pool small enough to force preemption, chunked prefill, prefix caching.

Each prompt runs alone in transformers; the engine runs all 24 together.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kubeinfer.runtime import LLM, SamplingParams

MAX_NEW = 16
LENGTHS = [
    1,
    2,
    3,
    5,
    8,
    13,
    15,
    16,
    17,
    31,
    32,
    33,
    47,
    64,
    65,
    100,
    127,
    128,
    129,
    160,
    200,
    255,
    257,
    300,
]

CORPUS = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
    "produce books faster than any scribe. Within fifty years, presses operated in more than two "
    "hundred cities across Europe, and the price of a book fell so far that ordinary merchants "
    "could own a small library. Scholars argue about how much the press changed thinking itself, "
    "but few doubt that it made ideas travel faster. Rivers shape the land they cross. Over "
    "thousands of years a river carves valleys, deposits fertile soil on its plains, and builds "
    "deltas where it meets the sea. Farmers settled along rivers because water meant crops, and "
    "cities grew where rivers could be crossed or where boats could unload their cargo. In "
    "computing, a cache keeps a copy of data close to where it is used, so that the next request "
    "is served quickly. The hard part is deciding what to keep: a cache that guesses well makes a "
    "slow system feel fast, and one that guesses badly only adds bookkeeping. Least recently used "
    "eviction is a simple rule that works surprisingly often. Bread is one of the oldest prepared "
    "foods. Flour and water, left to sit, collect wild yeasts and bacteria that make the dough "
    "rise and give sourdough its tang. Bakers learned to keep a piece of each batch to start the "
    "next, a habit that carried cultures of yeast across generations and continents. The night "
    "sky has guided travellers for as long as people have travelled. Sailors found north by the "
    "pole star, and the rising points of bright stars along the horizon gave island navigators a "
    "compass long before magnetic needles. Mathematics describes patterns: the spiral of a shell, "
    "the orbit of a planet, the spread of a rumour through a town. A good model leaves out almost "
    "everything and keeps only what matters for the question at hand."
)


def smollm2_prompts(tokenizer) -> list[list[int]]:  # noqa: ANN001
    ids = tokenizer.encode(CORPUS, add_special_tokens=False)
    assert len(ids) >= 370
    return [ids[(5 * i) % 70 : (5 * i) % 70 + n] for i, n in enumerate(LENGTHS)]


def random_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def shared_prefix_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Long shared prefixes (48 and 130 tokens), distinct suffixes."""
    base = max(prompts, key=len)
    return [base[: 48 if i % 2 else 130] + p[:20] for i, p in enumerate(prompts)]


def hf_greedy(model_dir: Path, prompts: list[list[int]], eos: int | None) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            gen = model.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=0,
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="module", params=["smollm2", "qwen2", "llama-gqa"])
def case(request, smollm2_dir: Path, tiny_models: dict[str, Path]):  # noqa: ANN001, ANN201
    name = request.param
    if name == "smollm2":
        from kubeinfer.runtime.tokenizer import Tokenizer

        model_dir, eos = smollm2_dir, 2
        prompts = smollm2_prompts(Tokenizer.from_dir(model_dir))
    else:
        model_dir, eos = tiny_models[name], 2
        prompts = random_prompts(384)
    shared = shared_prefix_prompts(prompts)
    return {
        "name": name,
        "dir": model_dir,
        "prompts": prompts,
        "shared": shared,
        "expected": hf_greedy(model_dir, prompts, eos),
        "expected_shared": hf_greedy(model_dir, shared, eos),
    }


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def run(case: dict, prompts_key: str = "prompts", **engine_args) -> tuple[list[list[int]], LLM]:  # noqa: ANN003
    llm = LLM(case["dir"], dtype="float32", **engine_args)
    outs = llm.generate(case[prompts_key], GREEDY)
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs], llm


def assert_same(ours: list[list[int]], expected: list[list[int]], name: str) -> None:
    for i, (a, b) in enumerate(zip(ours, expected, strict=True)):
        assert a == b, f"{name}: prompt {i} (length {LENGTHS[i]}): ours {a} != transformers {b}"


def test_defaults(case: dict) -> None:
    ours, _ = run(case)
    assert_same(ours, case["expected"], case["name"])


def test_small_pool_preempts(case: dict) -> None:
    # 40 blocks of 16 = 640 tokens for 24 prompts of up to 316 tokens: decodes must preempt
    ours, llm = run(case, num_kv_blocks=40)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same(ours, case["expected"], case["name"])


def test_chunked_prefill(case: dict) -> None:
    ours, llm = run(case, max_num_batched_tokens=48)
    assert llm.engine.stats.num_chunked_prefill_steps > 0
    assert_same(ours, case["expected"], case["name"])


def test_prefix_caching(case: dict) -> None:
    cached, llm = run(case, "shared", enable_prefix_caching=True)
    stats = llm.engine.kv_cache.prefix_stats
    assert stats.num_hit_tokens > 0 and stats.num_queried_tokens > stats.num_hit_tokens
    uncached, _ = run(case, "shared", enable_prefix_caching=False)
    assert cached == uncached
    assert_same(cached, case["expected_shared"], case["name"])
