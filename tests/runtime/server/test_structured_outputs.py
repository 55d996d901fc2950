"""Structured outputs with the official `openai` client against `kubeinfer serve` (SmolLM2)."""

from __future__ import annotations

import json
import re
from enum import StrEnum

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from .conftest import Server

MODEL = "smollm2-135m"


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)
    favourite_color: Color
    address: Address
    hobbies: list[str] = Field(max_length=2)


class Step(BaseModel):
    explanation: str = Field(max_length=40)
    output: str = Field(max_length=12)


class MathAnswer(BaseModel):
    steps: list[Step] = Field(min_length=1, max_length=1)
    final_answer: int = Field(ge=0, le=999)


class Verdict(BaseModel):
    is_capital: bool
    country: Color | None
    confidence: float = Field(ge=0, le=1)


@pytest.fixture(scope="module")
def client(smol_server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0, timeout=300
    )


@pytest.mark.parametrize(
    ("model", "question"),
    [
        (Person, "Describe a fictional person."),
        (MathAnswer, "What is 12 + 30? Answer step by step."),
        (Verdict, "Is Paris the capital of France?"),
    ],
)
def test_parse_returns_a_valid_object(
    client: openai.OpenAI, model: type[BaseModel], question: str
) -> None:
    r = client.beta.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        response_format=model,
        temperature=0,
        max_tokens=300,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, model)
    model.model_validate_json(choice.message.content)  # the text itself validates


def test_json_object_and_guided_fields(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Give me a JSON object describing a cat."}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=48,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a long object may be cut at max_tokens: it is still an object's beginning
        assert r.choices[0].message.content.startswith("{")
    choice = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        extra_body={"guided_choice": ["yes", "no", "maybe"]},
        temperature=0,
    )
    assert choice.choices[0].message.content in {"yes", "no", "maybe"}
    regex = client.completions.create(
        model=MODEL,
        prompt="My phone number is",
        extra_body={"guided_regex": r" \d{3}-\d{4}"},
        temperature=0,
        max_tokens=20,
    )
    assert re.fullmatch(r" \d{3}-\d{4}", regex.choices[0].text)
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["Paris", "Lyon"]}},
        "required": ["answer"],
    }
    guided = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body={"guided_json": schema},
        temperature=0,
    )
    assert json.loads(guided.choices[0].message.content) == {"answer": "Paris"}
    vllm_style = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}},
        temperature=0,
    )
    assert vllm_style.choices[0].message.content in {"Paris", "Lyon"}


def test_streamed_structured_output_equals_non_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a fictional person."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": Person.model_json_schema()},
        },
        temperature=0,
        max_tokens=300,
    )
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    Person.model_validate_json(text)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_json": {"type": "objec"}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a("}, "guided_regex"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}},
                }
            },
            "response_format",
        ),
    ],
)
def test_invalid_spec_is_a_400_naming_the_field(
    smol_server: Server, body: dict, param: str
) -> None:
    r = httpx.post(
        f"{smol_server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


@pytest.mark.parametrize(
    "body",
    [
        {"guided_regex": "a+", "guided_choice": ["a"]},  # two at once
        {"guided_choice": []},
        {"guided_regex": "a" * 70_000},  # over the size cap
        {"response_format": {"type": "json_schema"}},  # no schema
        {"response_format": {"type": "xml"}},
    ],
)
def test_bad_structured_output_fields_are_400(smol_server: Server, body: dict) -> None:
    r = httpx.post(
        f"{smol_server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
