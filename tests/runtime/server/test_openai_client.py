"""The official `openai` client against `kubeinfer serve` with SmolLM2."""

from __future__ import annotations

import openai
import pytest

from kubeinfer.runtime.tokenizer import Tokenizer

from .conftest import Server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smol_server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:  # noqa: ANN001
    return Tokenizer.from_dir(smollm2_dir)


def test_models_list(client: openai.OpenAI, smol_server: Server) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [smol_server.model_name]
    assert client.models.retrieve(smol_server.model_name).id == smol_server.model_name


def test_chat_answers_paris(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    r = client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=32
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(QUESTION))
    completion_ids = tokenizer.encode(r.choices[0].message.content, add_special_tokens=False)
    assert r.usage.completion_tokens == len(completion_ids) + 1  # + the <|im_end|> token
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, temperature=0, max_completion_tokens=32
    )
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m",
            messages=QUESTION,
            temperature=0,
            max_completion_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_completions_text_and_tokens(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    prompt = "The first five prime numbers are 2, 3, 5,"
    r = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 8
    by_ids = client.completions.create(
        model="smollm2-135m", prompt=tokenizer.encode(prompt), max_tokens=8, temperature=0
    )
    assert by_ids.choices[0].text == r.choices[0].text
    stream = list(
        client.completions.create(
            model="smollm2-135m",
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text
    assert stream[-1].usage.completion_tokens == 8


def test_completions_batch_of_prompts(client: openai.OpenAI) -> None:
    prompts = ["One, two,", "Monday, Tuesday,", "A, B, C,"]
    r = client.completions.create(model="smollm2-135m", prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, p in enumerate(prompts):
        alone = client.completions.create(
            model="smollm2-135m", prompt=p, max_tokens=4, temperature=0
        )
        assert r.choices[i].text == alone.choices[0].text
    assert r.usage.completion_tokens == 12


def test_stop_and_seed(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=32, stop=["Paris"]
    )
    assert "Paris" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    a, b = (
        client.completions.create(
            model="smollm2-135m", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7
        )
        for _ in range(2)
    )
    assert a.choices[0].text == b.choices[0].text
