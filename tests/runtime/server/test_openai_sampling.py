"""The sampling features of issue #18 with the official `openai` client against `kubeinfer
serve` and SmolLM2 (float32): logprobs against transformers, n > 1, penalties and logit_bias,
echo, /tokenize and /detokenize, and every new field refused by name when it is wrong.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
from pathlib import Path

import openai
import pytest
import torch

from kubeinfer.runtime.engine.sampling_params import SamplingParams
from kubeinfer.runtime.tokenizer import Tokenizer

from ..test_engine_greedy import CORPUS
from ..test_engine_sampling import reference_penalized_greedy
from .conftest import Server

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOL = 1e-3  # float32 on both sides, 30 layers summed in another order


@pytest.fixture(scope="module")
def client(smol_server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def hf(smollm2_dir: Path):  # noqa: ANN201
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)


@torch.no_grad()
def hf_greedy(hf, ids: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:  # noqa: ANN001
    """transformers' greedy continuation, and the log-softmax at every position of the whole."""
    out = hf.generate(
        torch.tensor([ids]), max_new_tokens=num_tokens, do_sample=False, eos_token_id=None
    )[0].tolist()
    logprobs = hf(torch.tensor([out])).logits[0].float().log_softmax(-1)
    return out[len(ids) :], logprobs


def assert_top(top: dict[str, float] | list, ref: torch.Tensor, tokenizer: Tokenizer) -> None:
    """Each (token, logprob) of a top list is the reference's value of that token, and the
    values are the reference's k largest."""
    pairs = list(top.items()) if isinstance(top, dict) else [(t.token, t.logprob) for t in top]
    ref_values, ref_ids = ref.topk(len(pairs) + 2)
    ranked = zip(ref_ids.tolist(), ref_values.tolist(), strict=True)
    by_text = {tokenizer.token_text(i): v for i, v in ranked}
    for token, value in pairs:
        assert abs(by_text[token] - value) < TOL, (token, value, by_text.get(token))


def chat_lp(c):  # noqa: ANN001, ANN201
    return c.choices[0].logprobs.content


def test_chat_logprobs_match_transformers(
    client: openai.OpenAI, tokenizer: Tokenizer, hf  # noqa: ANN001
) -> None:
    kwargs = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)
    r = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    prompt = tokenizer.encode_chat(QUESTION)
    ids, ref = hf_greedy(hf, prompt, len(content))
    for j, (entry, token) in enumerate(zip(content, ids, strict=True)):
        assert entry.token == tokenizer.token_text(token)
        assert entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - ref[len(prompt) - 1 + j, token].item()) < TOL
        assert len(entry.top_logprobs) == 5 and entry.top_logprobs[0].logprob >= entry.logprob
        assert_top(entry.top_logprobs, ref[len(prompt) - 1 + j], tokenizer)
    # the tokens spell the text (the last one may be <|im_end|>)
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content)
    # streamed: the same tokens and values (to float noise: the prompt is a prefix-cache hit
    # now, computed by another kernel path), spread over the chunks
    chunks = list(
        client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=5, stream=True)
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in chat_lp(c)]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    plain = client.chat.completions.create(**kwargs)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_completion_echo_with_prompt_logprobs(
    client: openai.OpenAI, tokenizer: Tokenizer, hf  # noqa: ANN001
) -> None:
    prompt = tokenizer.encode(CORPUS, add_special_tokens=False)[:40]
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=3, echo=True)
    r = client.completions.create(**kwargs)
    lp = r.choices[0].logprobs
    ids, ref = hf_greedy(hf, prompt, 4)
    everything = prompt + ids
    assert lp.tokens == [tokenizer.token_text(t) for t in everything]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(everything)):
        assert abs(lp.token_logprobs[j] - ref[j - 1, everything[j]].item()) < TOL
        top = lp.top_logprobs[j]
        assert 3 <= len(top) <= 4 and lp.tokens[j] in top  # the 3 most likely + the token
        assert_top({t: v for t, v in top.items() if t != lp.tokens[j]}, ref[j - 1], tokenizer)
    text = r.choices[0].text
    assert text.startswith(tokenizer.decode(prompt, skip_special_tokens=False))
    spans = zip(lp.text_offset, lp.tokens, strict=True)
    assert [text[o : o + len(t)] for o, t in spans] == lp.tokens
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens == len(prompt)
    # streamed: the same text, tokens, values and offsets
    chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == text
    for key in ("tokens", "text_offset"):
        assert [x for c in chunks for x in getattr(c.choices[0].logprobs, key)] == getattr(lp, key)
    values = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    # max_tokens 0: the prompt and its logprobs alone (the scoring request of eval harnesses)
    only = client.completions.create(**{**kwargs, "max_tokens": 0})
    assert only.choices[0].text == tokenizer.decode(prompt, skip_special_tokens=False)
    assert only.choices[0].logprobs.tokens == lp.tokens[: len(prompt)]
    assert only.usage.completion_tokens == 0
    echoed = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith("Paris is") and echoed.choices[0].logprobs is None


def test_n_choices(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    kwargs = dict(model=MODEL, messages=QUESTION, temperature=1.0, seed=5, max_tokens=6)
    r = client.chat.completions.create(**kwargs, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, choice in enumerate(r.choices):  # choice i samples as seed + i
        alone = client.chat.completions.create(**{**kwargs, "seed": 5 + i})
        assert choice.message.content == alone.choices[0].message.content
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(QUESTION))  # once, not 3 times
    chunks = list(client.chat.completions.create(**kwargs, n=3, stream=True))
    texts = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in r.choices]
    prompts = ["One, two,", "Monday, Tuesday,"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, best_of=2, max_tokens=4,
                                  temperature=0.8, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    second = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=4,
                                       temperature=0.8, seed=2)
    assert r.choices[3].text == second.choices[0].text


def test_logit_bias_and_penalties(
    client: openai.OpenAI, tokenizer: Tokenizer, hf  # noqa: ANN001
) -> None:
    target = tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt="I like", max_tokens=4, temperature=0,
                                  logit_bias={str(target): 100})
    assert r.choices[0].text == tokenizer.token_text(target) * 4
    prompt = tokenizer.encode("the cat sat on the mat, the cat sat on the", False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, presence_penalty=0.8,
                            frequency_penalty=0.6, repetition_penalty=1.3)
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, presence_penalty=0.8,
        frequency_penalty=0.6, extra_body={"repetition_penalty": 1.3, "ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].text == tokenizer.decode(reference_penalized_greedy(hf, prompt, params))
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert plain.choices[0].text != r.choices[0].text


def test_tokenize_and_detokenize(smol_server: Server, client: openai.OpenAI,
                                 tokenizer: Tokenizer) -> None:
    with smol_server.client() as c:
        t = c.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
        assert t == {"count": 2, "max_model_len": 8192, "tokens": tokenizer.encode("Hello world")}
        chat = c.post("/tokenize", json={"messages": QUESTION, "return_token_strs": True}).json()
        usage = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1).usage
        assert chat["count"] == len(chat["tokens"]) == usage.prompt_tokens
        assert "".join(chat["token_strs"]) == tokenizer.decode(chat["tokens"], False)
        d = c.post("/detokenize", json={"model": MODEL, "tokens": t["tokens"]}).json()
        assert d == {"prompt": "Hello world"}
        assert c.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
        for path, body, param in [
            ("/detokenize", {"tokens": [1, 49152]}, "tokens"),
            ("/detokenize", {"tokens": [-1]}, "tokens.0"),
            ("/detokenize", {"tokens": [1] * 8193}, "tokens"),
            ("/tokenize", {"prompt": "a", "messages": QUESTION}, "prompt"),
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": "x" * 300_000}, "prompt"),
            ("/tokenize", {"messages": [{"role": "user", "content": "x"}] * 2049}, "messages"),
        ]:
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            assert r.json()["error"]["param"] == param, r.text
        r = c.post("/tokenize", json={"model": "gpt-9", "prompt": "a"})
        assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]


BAD = [
    # (body fields, endpoint, param)
    ({"logit_bias": {"abc": 1}}, "completions", "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "completions", "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "completions", "logit_bias"),
    ({"logit_bias": {"5": "NaN"}}, "chat", "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "chat", "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "completions", "logit_bias"),
    ({"top_logprobs": 21, "logprobs": True}, "chat", "top_logprobs"),
    ({"top_logprobs": 2}, "chat", "top_logprobs"),
    ({"logprobs": 6}, "completions", "logprobs"),
    ({"logprobs": -1}, "completions", "logprobs"),
    ({"n": 0}, "chat", "n"),
    ({"n": 129}, "chat", "n"),
    ({"n": 65, "prompt": ["a", "b"]}, "completions", "n"),
    ({"n": 3, "best_of": 2}, "completions", "best_of"),
    ({"best_of": 4}, "completions", "best_of"),
    ({"max_tokens": 0}, "completions", "max_tokens"),
    ({"max_tokens": 0}, "chat", "max_tokens"),
    ({"repetition_penalty": 0}, "completions", "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "chat", "repetition_penalty"),
    ({"frequency_penalty": -2.1}, "chat", "frequency_penalty"),
    ({"presence_penalty": "high"}, "completions", "presence_penalty"),
    ({"echo": "maybe"}, "completions", "echo"),
    # a bug: echo decoded the prompt before its ids were checked (tokenizers raises past 2**32)
    ({"echo": True, "prompt": [1, 2**40]}, "completions", "prompt"),
    ({"echo": True, "prompt": [[5], [2**63 - 1]]}, "completions", "prompt"),
]


def test_bad_values_are_refused_by_name_and_fail_only_themselves(smol_server: Server) -> None:
    """Each bad request gets a 400 naming its field while a good stream runs beside them,
    which finishes whole."""
    base = {
        "completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
        "chat": {"model": MODEL, "messages": QUESTION, "max_tokens": 2},
    }

    def good_stream() -> str:
        body = {**base["chat"], "max_tokens": 24, "stream": True, "logprobs": True,
                "top_logprobs": 2, "n": 2, "frequency_penalty": 0.5}  # fmt: skip
        with smol_server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert all("error" not in e for e in events)
        return "".join(ch["delta"].get("content") or "" for e in events for ch in e["choices"])

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(good_stream)
        with smol_server.client() as c:
            for fields, endpoint, param in BAD:
                path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
                content = json.dumps({**base[endpoint], **fields}).replace('"NaN"', "NaN")
                r = c.post(path, content=content, headers={"Content-Type": "application/json"})
                assert r.status_code == 400, (fields, r.text)
                error = r.json()["error"]
                assert error["param"] == param, (fields, error)
                assert param.split(".")[0] in error["message"], (fields, error)
        assert running.result(timeout=300)
    metrics = smol_server.metrics()
    assert metrics["vllm:num_requests_running"] == 0
    assert math.isclose(metrics["vllm:kv_cache_usage_perc"], 0.0)
