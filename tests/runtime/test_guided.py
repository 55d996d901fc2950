"""Guided decoding in the batched engine: masks, neighbours, matcher lifetime (abort, preemption).

A random 2-layer model with SmolLM2's tokenizer: its tokens are noise, which is what a grammar
must hold in check.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kubeinfer.runtime import LLM, SamplingParams
from kubeinfer.runtime.engine.config import EngineConfig
from kubeinfer.runtime.engine.engine import Engine
from kubeinfer.runtime.engine.guided import GrammarMatchers
from kubeinfer.runtime.engine.guided_spec import GuidedSpec
from kubeinfer.runtime.errors import InvalidRequestError

from .server.conftest import make_tiny_chat_model

WORD = r"[a-z]{4,30}"


@pytest.fixture(scope="module")
def chat_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("guided"), smollm2_dir)


@pytest.fixture(scope="module")
def llm(chat_dir: Path) -> LLM:
    return LLM(chat_dir, dtype="float32", num_kv_blocks=512)


def word_params(max_tokens: int = 40, **kw: object) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0, guided=GuidedSpec("regex", WORD), **kw
    )


def test_constrained_rows_match_and_neighbours_are_untouched(llm: LLM) -> None:
    prompts = [f"Request number {i}: tell me something." for i in range(16)]
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [llm.generate(p, free)[0].outputs[0].token_ids for p in prompts[1::2]]
    params = [word_params() if i % 2 == 0 else free for i in range(16)]
    batch = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in batch[1::2]] == alone
    for out in batch[0::2]:
        assert re.fullmatch(WORD, out.outputs[0].text), out.outputs[0].text
    guided_alone = llm.generate(prompts[0], word_params())[0].outputs[0].token_ids
    assert batch[0].outputs[0].token_ids == guided_alone
    assert llm.engine.runner.grammar_matchers.num_matchers == 0


def test_json_schema_and_choice(llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog"]},
            "legs": {"type": "integer", "minimum": 0, "maximum": 8},
            "ok": {"type": "boolean"},
        },
        "required": ["kind", "legs", "ok"],
        "additionalProperties": False,
    }
    specs = [
        GuidedSpec("json", json.dumps(schema)),
        GuidedSpec("choice", choices=("alpha", "beta", 'say "hi"')),
        GuidedSpec("json", '{"type": "object"}'),
    ]
    outs = llm.generate(
        ["Answer.", "Pick one.", "An object."],
        [SamplingParams(max_tokens=60, temperature=0, guided=s) for s in specs],
    )
    data = json.loads(outs[0].outputs[0].text)
    assert set(data) == {"kind", "legs", "ok"} and data["kind"] in {"cat", "dog"}
    assert 0 <= data["legs"] <= 8
    assert outs[1].outputs[0].text in {"alpha", "beta", 'say "hi"'}
    assert outs[1].outputs[0].finish_reason == "stop"
    assert outs[2].outputs[0].text.startswith("{")


def test_special_tokens_never_inside_a_string(llm: LLM) -> None:
    """`<|im_start|>` spelled as characters is valid string content: it must not be a token."""
    import xgrammar as xgr

    grammar = llm.engine.grammars.compile(GuidedSpec("regex", r"[^\n]{1,50}"))
    matcher = xgr.GrammarMatcher(grammar)
    mask = xgr.allocate_token_bitmask(1, llm.engine.runner.num_logits)
    matcher.fill_next_token_bitmask(mask, 0)
    allowed = set(range(llm.engine.runner.num_logits)) - set(
        xgr.testing._get_masked_tokens_from_bitmask(mask, llm.engine.runner.num_logits)
    )
    assert not allowed & set(range(17))  # SmolLM2's added special tokens, EOS (2) included
    assert 28 in allowed  # an ordinary token


def test_abort_frees_the_matcher(chat_dir: Path) -> None:
    engine = Engine(chat_dir, EngineConfig(num_kv_blocks=64), dtype="float32")
    engine.add_request("Hello there", word_params(max_tokens=30), request_id="g")
    engine.add_request("Hello there", SamplingParams(max_tokens=30), request_id="free")
    matchers = engine.runner.grammar_matchers
    engine.step()
    engine.step()
    assert matchers.num_matchers == 1
    engine.abort("g")
    assert matchers.num_matchers == 0
    while engine.has_unfinished:
        engine.step()
    assert matchers.num_matchers == 0


def test_preemption_frees_the_matcher_and_the_replay_resumes_it(chat_dir: Path) -> None:
    """A pool of 8 blocks (128 tokens) for two requests of 97: one is preempted, its matcher
    freed; recomputed later, its matcher is rebuilt from its output and it ends as alone."""
    prompt = list(range(100, 156))  # 56 tokens
    digits = r"[0-9]{40}"  # 40 tokens: SmolLM2 has one token per digit
    params = SamplingParams(max_tokens=41, temperature=0, guided=GuidedSpec("regex", digits))
    alone_engine = Engine(chat_dir, EngineConfig(num_kv_blocks=64), dtype="float32")
    alone_engine.add_request(prompt, params, request_id="a")
    alone = []
    while alone_engine.has_unfinished:
        alone += [o for o in alone_engine.step() if o.finished]
    engine = Engine(chat_dir, EngineConfig(num_kv_blocks=8), dtype="float32")
    engine.add_request(prompt, params, request_id="a")
    engine.add_request(prompt[::-1], params, request_id="b")
    matchers = engine.runner.grammar_matchers
    finished, freed_on_preemption = {}, False
    while engine.has_unfinished:
        before = engine.scheduler.num_preemptions
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if engine.scheduler.num_preemptions > before:
            waiting = [r.request_id for r in engine.scheduler.waiting if not r.is_finished]
            assert waiting and all(rid not in matchers._matchers for rid in waiting)
            freed_on_preemption = True
    assert freed_on_preemption
    assert finished["a"].outputs[0].token_ids == alone[0].outputs[0].token_ids
    for out in finished.values():
        assert re.fullmatch(digits, out.outputs[0].text), out.outputs[0].text
    assert matchers.num_matchers == 0


def test_unconstrained_steps_do_no_guided_work(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object) -> None:
        raise AssertionError("mask_logits ran for a step without guided requests")

    monkeypatch.setattr(GrammarMatchers, "mask_logits", fail)
    out = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0))
    assert out[0].outputs[0].finish_reason in {"stop", "length"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GuidedSpec("json", '{"type": "objec"}'), "objec"),
        (GuidedSpec("json", "{"), "guided_json"),
        (GuidedSpec("regex", "a(", param="guided_regex"), "parenthesis"),
        (GuidedSpec("grammar", "root ::= nope", param="guided_grammar"), "guided_grammar"),
    ],
)
def test_invalid_specs_name_the_field(llm: LLM, spec: GuidedSpec, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        llm.generate("x", SamplingParams(max_tokens=2, guided=spec))
    assert info.value.param == spec.param
    assert not llm.engine.has_unfinished


def test_spec_sizes_are_capped() -> None:
    with pytest.raises(InvalidRequestError, match="at most"):
        GuidedSpec("regex", "a" * 70_000, param="guided_regex")
    with pytest.raises(InvalidRequestError, match="at most"):
        GuidedSpec("choice", choices=tuple(str(i) for i in range(300)), param="guided_choice")
    with pytest.raises(InvalidRequestError, match="non-empty"):
        GuidedSpec("choice", choices=("a", ""), param="guided_choice")
