"""Tool calls in and out of the model: prompts rendered with the tools, outputs parsed into calls.

In: the model's chat template gets `tools` (and assistant `tool_calls`, with arguments as
objects, and `tool` messages), as transformers and vLLM give them. A template that knows no
tools (SmolLM2's) gets them the Hermes way instead: a system message listing them in
`<tools>` and asking for `<tool_call>` JSON, earlier calls written as `<tool_call>` text and
results as `<tool_response>` text.

Out, by `tool_choice`: "required" output is the grammar's JSON array of `{"name",
"parameters"}`; a named function's output is its arguments; "auto" output is parsed from the
model's own format: Hermes `<tool_call>{"name", "arguments"}</tool_call>` (Qwen2.5/3,
and the fallback above) or a Llama 3 JSON object `{"name", "parameters"}` (optionally after
`<|python_tag|>`), a call only when it names one of the tools; else it is text. Under "auto"
the model writes free text, but once it opens a call in its template's format, xgrammar's
structural tag for that format holds the call to a tool's name and arguments schema
(`auto_tool_spec`), so a call it makes is a valid one.

Streaming (`ToolCallStream`): text that may still turn into a call is held back; each call
goes out whole (id, name, arguments) in one `delta.tool_calls` entry once it is known.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kubeinfer.runtime.engine.guided_spec import GuidedSpec
from kubeinfer.runtime.errors import InvalidRequestError

if TYPE_CHECKING:
    from kubeinfer.runtime.server.protocol import ChatCompletionRequest

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str
    """JSON text of the arguments object."""
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


# in


def template_inputs(
    body: ChatCompletionRequest, chat_template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and the extra template variables (`tools`) to render `body` with."""
    messages = [m.as_template_message() for m in body.messages]
    if not body.tools:
        return messages, {}
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if chat_template is not None and "tools" in chat_template:
        return messages, {"tools": tools}
    return _hermes_fallback(messages, tools), {}


def _hermes_fallback(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    prompt = (
        "You may call one or more functions to assist with the user query. The functions are "
        f"listed within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\n"
        "For each function call, return a JSON object with the function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join(
                f"{_OPEN}\n{json.dumps(_hermes_call(c['function']))}\n</tool_call>"
                for c in m.pop("tool_calls")
            )
            m["content"] = f"{m['content']}\n{calls}".strip()
        if m["role"] == "tool":
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
            m.pop("tool_call_id", None)
        out.append(m)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _hermes_call(function: dict[str, Any]) -> dict[str, Any]:
    return {"name": function["name"], "arguments": function["arguments"]}


def tool_call_format(chat_template: str | None) -> str:
    """xgrammar's name for the template's call format: Llama 3 JSON, or Hermes (Qwen's, and
    what a template without tools gets)."""
    if chat_template and "tools" in chat_template and _OPEN not in chat_template:
        if _PYTHON_TAG in chat_template or "ipython" in chat_template:
            return "llama"
    return "qwen_3"


def auto_tool_spec(body: ChatCompletionRequest, chat_template: str | None) -> GuidedSpec | None:
    """tool_choice auto: free text, with any call held to the tools' schemas."""
    if body.tool_mode != "auto":
        return None
    import xgrammar

    try:
        tag = xgrammar.get_builtin_structural_tag(
            tool_call_format(chat_template),
            tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
            tool_choice="auto",
            reasoning=False,
            parallel_tool_calls=body.parallel_tool_calls,
        )
    except Exception as e:  # noqa: BLE001 - a tool definition xgrammar cannot take
        raise InvalidRequestError(f"tools: {e}".splitlines()[0][:300], "tools") from None
    return GuidedSpec("structural_tag", tag.model_dump_json(), param="tools")


# out


def parse_output(text: str, body: ChatCompletionRequest) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished output; calls empty when the model wrote text."""
    mode = body.tool_mode
    if mode == "none":
        return text, []
    if mode == "named":
        assert body.tool_choice is not None and not isinstance(body.tool_choice, str)
        return None, [ParsedCall(body.tool_choice.function.name, _compact(text))]
    if mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:  # cut at max_tokens: the text is all there is
            return text, []
        return None, [ParsedCall(i["name"], json.dumps(i["parameters"])) for i in items]
    return parse_auto(text, set(body.tool_names))


def tool_finish_reason(
    reason: str | None, calls: list[ParsedCall], body: ChatCompletionRequest
) -> str | None:
    """ "tool_calls" when the model stopped on calls (a named function's call stays "stop",
    as OpenAI and vLLM answer it)."""
    if calls and reason == "stop" and body.tool_mode != "named":
        return "tool_calls"
    return reason


def parse_auto(text: str, names: set[str]) -> tuple[str | None, list[ParsedCall]]:
    if _OPEN in text:
        calls = [c for m in _HERMES.finditer(text) if (c := _call(m.group(1), names))]
        if calls:
            content = text[: text.index(_OPEN)].strip()
            return content or None, calls
        return text, []
    stripped = text.strip().removeprefix(_PYTHON_TAG).strip()
    if stripped.startswith("{"):
        calls = [c for part in stripped.split(";") if (c := _call(part, names))]
        if calls:
            return None, calls
    return text, []


def _call(payload: str, names: set[str]) -> ParsedCall | None:
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except json.JSONDecodeError:
        return text


class ToolCallStream:
    """A chat stream's text split into content to send now and calls to send at the end."""

    def __init__(self, body: ChatCompletionRequest) -> None:
        self.body = body
        self.mode = body.tool_mode
        self._text = ""
        self._sent = 0  # characters of _text already sent as content
        self._held = self.mode in ("required", "named")  # all of it is calls

    def push(self, delta: str) -> str:
        """The content that can go out now."""
        self._text += delta
        if self.mode == "none":
            self._sent = len(self._text)
            return delta
        if self._held:
            return ""
        rest = self._text[self._sent :]
        if not self._text[: self._sent].strip() and rest.lstrip().startswith(("{", _PYTHON_TAG)):
            self._held = True  # a Llama 3 JSON call may be starting
            return ""
        cut = rest.find(_OPEN)
        if cut >= 0:
            self._held = True
        else:
            cut = len(rest) - _partial_suffix(rest, _OPEN)
        self._sent += cut
        return rest[:cut]

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the end: (content not sent yet, calls)."""
        if self.mode == "none":
            return "", []
        content, calls = parse_output(self._text, self.body)
        if not calls:
            return self._text[self._sent :], []
        already = self._text[: self._sent]
        rest = (content or "")[len(already) :] if (content or "").startswith(already) else ""
        return rest, calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
