"""Tool calling with the official `openai` client against `kubeinfer serve` (SmolLM2)."""

from __future__ import annotations

import json
from enum import StrEnum

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from .conftest import Server

MODEL = "smollm2-135m"


class Unit(StrEnum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=32)
    unit: Unit


class TimeArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timezone: str = Field(max_length=32)


def tool(name: str, description: str, args: type[BaseModel]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": args.model_json_schema(),
        },
    }


TOOLS = [
    tool("get_weather", "Get the current weather in a city", WeatherArgs),
    tool("get_time", "Get the current time in a timezone", TimeArgs),
]
ARGS = {"get_weather": WeatherArgs, "get_time": TimeArgs}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(smol_server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0, timeout=300
    )


def assert_valid_calls(calls: list) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        ARGS[call.function.name].model_validate_json(call.function.arguments)


def test_required_returns_calls_whose_arguments_validate(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=120,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message.tool_calls)


def test_named_function_is_called(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=120,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "stop"
    assert_valid_calls([call])


def test_auto_returns_text_or_a_valid_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=120
    )
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert_valid_calls(choice.message.tool_calls)
    else:
        assert choice.message.content and choice.finish_reason in {"stop", "length"}


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_calls_reassemble_to_the_same_call(
    client: openai.OpenAI, tool_choice: str
) -> None:
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=60,
    )
    full = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    calls: dict[int, dict] = {}
    content = ""
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    expected = [
        {"name": c.function.name, "arguments": json.loads(c.function.arguments)}
        for c in full.message.tool_calls or []
    ]
    got = [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls.values()]
    assert got == expected and finish == full.finish_reason
    assert all(c["id"] for c in calls.values())
    assert content.strip() == (full.message.content or "").strip()


def test_n_choices_each_get_calls_and_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    """n > 1 with tools: each sibling is held to the tools' grammar, has its own calls (in its
    own index) and the logprobs of the tokens it wrote, streamed or not."""
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        n=2,
        temperature=1.0,
        seed=3,
        logprobs=True,
        max_tokens=80,
    )
    r = client.chat.completions.create(**kwargs)
    assert sorted(c.index for c in r.choices) == [0, 1]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert_valid_calls(choice.message.tool_calls)
        assert choice.logprobs is not None and choice.logprobs.content
    calls: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str] = {}
    num_logprobs = {0: 0, 1: 0}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                calls[choice.index] += d.function.arguments if d.function else ""
            if choice.logprobs is not None:
                num_logprobs[choice.index] += len(choice.logprobs.content or [])
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for i, choice in enumerate(sorted(r.choices, key=lambda c: c.index)):
        # the same seeds: the streamed calls are the whole response's, token for token
        assert json.loads(calls[i]) == json.loads(choice.message.tool_calls[0].function.arguments)
        assert num_logprobs[i] == len(choice.logprobs.content)


def test_tool_results_go_back_to_the_model(client: openai.OpenAI) -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees celsius."},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=24
    )
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": 5}}}]},
            "tools",
        ),
    ],
)
def test_bad_tools_are_400(smol_server: Server, extra: dict, param: str) -> None:
    r = httpx.post(
        f"{smol_server.url}/v1/chat/completions",
        json={"messages": ASK, "tools": TOOLS, "tool_choice": "required", **extra},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"]
