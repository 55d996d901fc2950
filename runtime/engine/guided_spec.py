"""GuidedSpec: what a request's output must match (a JSON schema, a regex, a choice, a grammar).

Device-free and library-free: the server builds one from the request body, `SamplingParams`
carries it, and `guided.py` compiles it. Sizes are bounded here (a schema is compiled on a
CPU thread: its cost must be capped before that), and every error names the request field the
spec came from (`param`), which the server answers with a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kubeinfer.runtime.errors import InvalidRequestError

GuidedKind = Literal["json", "regex", "choice", "grammar", "structural_tag"]

MAX_SPEC_CHARS = 64 * 1024
"""The most characters a schema (as JSON text), regex or grammar may have."""
MAX_CHOICES = 256
"""The most strings a choice may list."""
MAX_CHOICE_CHARS = 1024
"""The most characters one choice may have."""

JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""`response_format: {type: json_object}`: any JSON object."""


@dataclass(frozen=True, slots=True)
class GuidedSpec:
    kind: GuidedKind
    """json: `value` is a JSON schema as text; regex; choice: `choices`; grammar: EBNF (GBNF);
    structural_tag: xgrammar's structural tag as JSON text (free text with constrained parts)."""
    value: str = ""
    choices: tuple[str, ...] = ()
    param: str = "guided_json"
    """The request field it came from (named in errors)."""

    def __post_init__(self) -> None:
        if self.kind == "choice":
            if not self.choices:
                raise InvalidRequestError(
                    f"{self.param}: must list at least one choice", self.param
                )
            if len(self.choices) > MAX_CHOICES:
                raise InvalidRequestError(
                    f"{self.param}: at most {MAX_CHOICES} choices are allowed, "
                    f"got {len(self.choices)}",
                    self.param,
                )
            if any(not isinstance(c, str) or not c for c in self.choices):
                raise InvalidRequestError(
                    f"{self.param}: every choice must be a non-empty string", self.param
                )
            if any(len(c) > MAX_CHOICE_CHARS for c in self.choices):
                raise InvalidRequestError(
                    f"{self.param}: a choice may have at most {MAX_CHOICE_CHARS} characters",
                    self.param,
                )
            return
        if not isinstance(self.value, str) or not self.value:
            raise InvalidRequestError(f"{self.param}: must not be empty", self.param)
        if len(self.value) > MAX_SPEC_CHARS:
            raise InvalidRequestError(
                f"{self.param}: at most {MAX_SPEC_CHARS} characters are allowed, "
                f"got {len(self.value)}",
                self.param,
            )
