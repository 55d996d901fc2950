"""The request fields of tool calling: `tools`, `tool_choice`, `parallel_tool_calls`, and the
messages that carry calls (assistant `tool_calls`) and results (`tool` role).

Tool definitions are checked at the boundary: names as OpenAI allows them, unique, at most
`MAX_TOOLS`, each parameters schema at most `MAX_SPEC_CHARS` as JSON. `tool_choice`
"required" or a named function is enforced by a JSON-schema grammar (as vLLM does): "required"
makes the model write a JSON array of `{"name", "parameters"}`, a named function makes it
write that function's arguments; "auto" leaves the model free and its own format is parsed
(tool_parsers.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kubeinfer.runtime.engine.guided_spec import MAX_SPEC_CHARS, GuidedSpec

MAX_TOOLS = 128
ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: ToolName
    description: Annotated[str, Field(max_length=8192)] | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: ToolName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(BaseModel):
    """Mixed into the chat request body."""

    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """What the tools ask of this request: none when there are none or none may be called."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else "auto"

    @property
    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    def check_tools(self) -> None:
        """ValueError naming the field for tool definitions and choices that cannot be served."""
        names = self.tool_names
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        for tool in self.tools or []:
            size = len(json.dumps(tool.function.parameters_schema))
            if size > MAX_SPEC_CHARS:
                raise ValueError(
                    f"tools: the parameters of {tool.function.name!r} have {size} characters "
                    f"as JSON; at most {MAX_SPEC_CHARS} are allowed"
                )
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool named {choice.function.name!r} in tools")

    def tool_guided_spec(self) -> GuidedSpec | None:
        """The grammar that enforces `tool_choice` required or named (None for auto/none)."""
        mode = self.tool_mode
        if mode == "named":
            assert isinstance(self.tool_choice, NamedToolChoice)  # by tool_mode
            name = self.tool_choice.function.name
            (tool,) = [t for t in self.tools or [] if t.function.name == name]
            schema = tool.function.parameters_schema
            return GuidedSpec("json", json.dumps(schema), param="tool_choice")
        if mode != "required":
            return None
        # each tool's `$defs` move to the root, where its `#/$defs/...` references now point
        defs: dict[str, Any] = {}
        parameters = {}
        for t in self.tools or []:
            schema = dict(t.function.parameters_schema)
            own = schema.pop("$defs", None) or {}
            if not isinstance(own, dict):
                raise ValueError(f"tools: $defs of {t.function.name!r} must be an object")
            for key, value in own.items():
                if defs.setdefault(key, value) != value:
                    raise ValueError(f"tools: two tools define $defs/{key} differently")
            parameters[t.function.name] = schema
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "enum": [t.function.name]},
                            "parameters": parameters[t.function.name],
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for t in self.tools or []
                ]
            },
        }
        if not self.parallel_tool_calls:
            calls["maxItems"] = 1
        if defs:
            calls["$defs"] = defs
        return GuidedSpec("json", json.dumps(calls), param="tools")
