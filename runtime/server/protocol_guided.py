"""The request fields of structured outputs, and the one `GuidedSpec` they ask for.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and vLLM's extra fields
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs`
({json, regex, choice, grammar, json_object}). At most one of them may constrain a request;
sizes are bounded by `GuidedSpec`, and whether a schema or regex compiles is checked when it
is compiled (guided.py), both as a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from kubeinfer.runtime.engine.guided_spec import JSON_OBJECT_SCHEMA, GuidedSpec

SchemaName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: SchemaName
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its newer spelling of the guided_* fields)."""

    model_config = ConfigDict(extra="forbid")
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[StrictStr] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class GuidedFields(BaseModel):
    """Mixed into the completion and chat request bodies."""

    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    def guided_spec(self) -> GuidedSpec | None:
        """The spec of the one field that constrains the output, or None; a ValueError if
        several do (pydantic's validators, and the server, answer it with a 400)."""
        specs = [s for s in self._guided_specs() if s is not None]
        if len(specs) > 1:
            names = ", ".join(s.param for s in specs)
            raise ValueError(f"give at most one of the structured output fields, got {names}")
        return specs[0] if specs else None

    def _guided_specs(self) -> list[GuidedSpec | None]:
        specs = [
            _json("guided_json", self.guided_json),
            _text("regex", "guided_regex", self.guided_regex),
            _choice("guided_choice", self.guided_choice),
            _text("grammar", "guided_grammar", self.guided_grammar),
        ]
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            specs.append(GuidedSpec("json", JSON_OBJECT_SCHEMA, param="response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.json_schema if fmt.json_schema else None
            if schema is None:
                raise ValueError("response_format: json_schema needs json_schema.schema")
            specs.append(_json("response_format", schema))
        so = self.structured_outputs
        if so is not None:
            param = "structured_outputs"
            specs += [
                _json(param, so.json_),
                _text("regex", param, so.regex),
                _choice(param, so.choice),
                _text("grammar", param, so.grammar),
                GuidedSpec("json", JSON_OBJECT_SCHEMA, param=param) if so.json_object else None,
            ]
        return specs


def _json(param: str, schema: str | dict[str, Any] | None) -> GuidedSpec | None:
    if schema is None:
        return None
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return GuidedSpec("json", text, param=param)


def _text(kind: Literal["regex", "grammar"], param: str, value: str | None) -> GuidedSpec | None:
    return None if value is None else GuidedSpec(kind, value, param=param)


def _choice(param: str, choices: list[str] | None) -> GuidedSpec | None:
    return None if choices is None else GuidedSpec("choice", choices=tuple(choices), param=param)
