"""Tool calls without a model: templates rendered with tools, outputs parsed, streams split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubeinfer.runtime.engine.guided import GrammarCompiler
from kubeinfer.runtime.server.protocol import ChatCompletionRequest
from kubeinfer.runtime.server.tool_calls import (
    ToolCallStream,
    auto_tool_spec,
    parse_output,
    template_inputs,
    tool_call_format,
)
from kubeinfer.runtime.tokenizer import Tokenizer

TEMPLATES = Path(__file__).with_name("templates")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
]


def body(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": CONVERSATION, "tools": [WEATHER, TIME], **kw}
    )


def render(template: str, b: ChatCompletionRequest, smollm2_dir: Path) -> str:
    tok = Tokenizer.from_dir(smollm2_dir)
    tok.chat_template = template
    messages, extra = template_inputs(b, template)
    return tok.apply_chat_template(messages, **extra)


def test_hermes_template_gets_tools_calls_and_results(smollm2_dir: Path) -> None:
    text = render((TEMPLATES / "hermes_tools.jinja").read_text(), body(), smollm2_dir)
    assert '"name": "get_weather"' in text.split("</tools>\n\nFor each")[0]  # the definitions
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<tool_response>\n21 degrees\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_llama3_template_gets_tools_calls_and_results(smollm2_dir: Path) -> None:
    text = render((TEMPLATES / "llama3_json_tools.jinja").read_text(), body(), smollm2_dir)
    assert '"name": "get_weather"' in text and "Given the following functions" in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n21 degrees" in text


def test_a_template_without_tools_gets_them_the_hermes_way(smollm2_dir: Path) -> None:
    template = (smollm2_dir / "chat_template.jinja").read_text()
    assert "tools" not in template  # SmolLM2's
    text = render(template, body(), smollm2_dir)
    assert text.startswith("<|im_start|>system\nYou may call one or more functions")
    assert '{"name": "get_weather", "description": "Current weather' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<tool_response>\n21 degrees\n</tool_response>" in text


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Just text.", "Just text.", []),
        (
            'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
            "</tool_call>",
            "Sure.",
            [("get_weather", {"city": "Oslo", "unit": "c"}), ("get_time", {})],
        ),
        (  # cut before its closing tag: still a call
            '<tool_call>\n{"name": "get_time", "arguments": {}}',
            None,
            [("get_time", {})],
        ),
        (  # Llama 3 JSON, with and without the python tag
            '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "f"}}',
            None,
            [("get_weather", {"city": "Rome", "unit": "f"})],
        ),
        ('<|python_tag|>{"name": "get_time", "parameters": {}}', None, [("get_time", {})]),
        (
            '{"name": "not_a_tool", "parameters": {}}',
            '{"name": "not_a_tool", "parameters": {}}',
            [],
        ),
        ('<tool_call>{"name": broken</tool_call>', '<tool_call>{"name": broken</tool_call>', []),
    ],
)
def test_auto_outputs_are_parsed(text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = parse_output(text, body())
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


def test_required_and_named_outputs() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}]'
    content, calls = parse_output(text, body(tool_choice="required"))
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo", "unit": "c"}')
    ]
    named = body(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, calls = parse_output('{"city": "Oslo", "unit": "c"}', named)
    assert content is None and calls[0].name == "get_weather"
    assert parse_output("text", body(tool_choice="none")) == ("text", [])


@pytest.mark.parametrize(
    "text",
    [
        "Plain answer, no calls at all.",
        'Let me check.<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "f"}}',
        "A < b and <tool but no call",
    ],
)
def test_stream_splits_content_and_calls_like_the_whole_text(text: str) -> None:
    b = body()
    stream = ToolCallStream(b)
    sent = "".join(stream.push(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, calls = stream.finish()
    content, whole_calls = parse_output(text, b)
    assert (sent + rest).strip() == (content or "").strip()
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tools": [WEATHER, WEATHER]}, "unique"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "no tool named"),
        ({"tools": None, "tool_choice": "required"}, "needs tools"),
        ({"tool_choice": "required", "guided_regex": "a+"}, "cannot be combined"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "pattern"),
    ],
)
def test_bad_tool_fields_are_refused(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        b = ChatCompletionRequest.model_validate(
            {"messages": CONVERSATION, "tools": [WEATHER], **extra}
        )
        b.guided_spec()


def test_required_grammar_moves_each_tools_defs_to_the_root() -> None:
    unit = {"enum": ["c", "f"]}
    params = {
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "$defs": {"Unit": unit},
    }
    tools = [
        {"type": "function", "function": {"name": n, "parameters": params}} for n in ("a", "b")
    ]
    b = ChatCompletionRequest.model_validate(
        {"messages": CONVERSATION, "tools": tools, "tool_choice": "required"}
    )
    spec = b.guided_spec()
    assert spec is not None
    schema = json.loads(spec.value)
    assert schema["$defs"] == {"Unit": unit}
    assert all("$defs" not in item["properties"]["parameters"] for item in schema["items"]["anyOf"])
    clash = [
        tools[0],
        {
            "type": "function",
            "function": {"name": "c", "parameters": {**params, "$defs": {"Unit": {"enum": ["k"]}}}},
        },
    ]
    with pytest.raises(ValueError, match="differently"):
        ChatCompletionRequest.model_validate(
            {"messages": CONVERSATION, "tools": clash, "tool_choice": "required"}
        )


def test_template_formats() -> None:
    assert tool_call_format((TEMPLATES / "hermes_tools.jinja").read_text()) == "qwen_3"
    assert tool_call_format((TEMPLATES / "llama3_json_tools.jinja").read_text()) == "llama"
    assert tool_call_format(None) == "qwen_3"  # the Hermes fallback


def test_auto_grammar_leaves_text_free_and_holds_calls_to_the_schemas(smollm2_dir: Path) -> None:
    import xgrammar as xgr

    compiler = GrammarCompiler(Tokenizer.from_dir(smollm2_dir), 49152, [2])
    spec = auto_tool_spec(body(), None)
    assert spec is not None and auto_tool_spec(body(tool_choice="none"), None) is None
    grammar = compiler.compile(spec)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
    assert xgr.GrammarMatcher(grammar).accept_string("Any text at all, even { and <tags>.")
    assert xgr.GrammarMatcher(grammar).accept_string(f"Let me look.{call}\n</tool_call>")
    bad_unit = call.replace('"c"', '"kelvin"')
    assert not xgr.GrammarMatcher(grammar).accept_string(bad_unit)
    assert not xgr.GrammarMatcher(grammar).accept_string('<tool_call>\n{"name": "nope"')
