"""Write README.md's generated sections, so they cannot drift from their sources.

    python hack/readme_sections.py          # rewrite the blocks between the README's markers
    python hack/readme_sections.py --check  # exit 1 when the README is not current

- The InferenceModel reference, from the CRD's schema: every spec field gets a row with its
  path, type, default, constraints (ranges, enums, patterns, CEL rules that name it) and
  description. A spec field without a description is an error, so none lands undocumented.
- The benchmark summary, from bench/RESULTS.md: the latest row of each benchmark and setup
  (one per dtype, concurrency, ...; the machine's load, which some setups note, is not part
  of it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "crds" / "inferencemodels.kubeinfer.dev.yaml"
README = REPO / "README.md"
RESULTS = REPO / "bench" / "RESULTS.md"
BEGIN = "<!-- BEGIN inferencemodel-reference (hack/readme_sections.py writes this) -->"
END = "<!-- END inferencemodel-reference -->"
BENCH_BEGIN = "<!-- BEGIN bench-summary (hack/readme_sections.py writes this) -->"
BENCH_END = "<!-- END bench-summary -->"


class ReferenceError(Exception):
    """The CRD or the README is not what the generator expects."""


def _schema(crd_path: Path) -> dict[str, Any]:
    crd = yaml.safe_load(crd_path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return version["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "int or string"
    kind = node.get("type", "object")
    if kind == "array":
        return f"[]{_type(node.get('items', {}))}"
    if kind == "object" and "additionalProperties" in node:
        return f"map[string]{_type(node['additionalProperties'])}"
    return str(kind)


def _constraints(node: dict[str, Any]) -> str:
    parts: list[str] = []
    low, high = node.get("minimum"), node.get("maximum")
    if low is not None or high is not None:
        above = "> " if node.get("exclusiveMinimum") else ">= "
        below = "< " if node.get("exclusiveMaximum") else "<= "
        left = "" if low is None else above + str(low)
        right = "" if high is None else below + str(high)
        parts.append(", ".join(p for p in (left, right) if p))
    for key, label in (("minLength", "length >="), ("maxLength", "length <="),
                       ("maxItems", "items <=")):
        if key in node:
            parts.append(f"{label} {node[key]}")
    if "enum" in node:
        parts.append("one of " + ", ".join(f"`{v}`" if v != "" else '`""`' for v in node["enum"]))
    if "pattern" in node and not node.get("x-kubernetes-int-or-string"):
        parts.append(f"matches `{node['pattern']}`")
    for rule in node.get("x-kubernetes-validations", []):
        if "fieldPath" not in rule:
            parts.append(rule["message"])
    return "; ".join(parts)


def _default(node: dict[str, Any]) -> str:
    if "default" not in node:
        return ""
    return f"`{json.dumps(node['default'])}`"


def _rows(node: dict[str, Any], path: str, in_item: bool) -> Iterator[tuple[str, ...]]:
    parent_rules = {
        rule["fieldPath"].lstrip("."): rule["message"]
        for rule in node.get("x-kubernetes-validations", [])
        if "fieldPath" in rule
    }
    for name, child in node.get("properties", {}).items():
        child_path = f"{path}.{name}"
        description = child.get("description", "")
        if not description and not in_item:
            raise ReferenceError(f"{child_path} has no description in {CRD.name}")
        constraints = "; ".join(c for c in (_constraints(child), parent_rules.get(name)) if c)
        yield (child_path, _type(child), _default(child), constraints, description)
        if child.get("x-kubernetes-preserve-unknown-fields"):
            continue
        if child.get("type") == "array" and "properties" in child.get("items", {}):
            yield from _rows(child["items"], f"{child_path}[]", True)
        elif "properties" in child:
            yield from _rows(child, child_path, in_item)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(crd_path: Path = CRD) -> str:
    """The reference as markdown: the spec table, then the status fields."""
    schema = _schema(crd_path)
    properties = schema["properties"]
    lines = [
        BEGIN,
        "",
        "| Field | Type | Default | Constraints | Meaning |",
        "|---|---|---|---|---|",
    ]
    for row in _rows(properties["spec"], "spec", False):
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    status = properties.get("status", {}).get("properties", {})
    lines += [
        "",
        "Status (written by the operator): "
        + ", ".join(f"`{name}`" for name in status)
        + ".",
        "",
        END,
    ]
    return "\n".join(lines)


def render_bench(results_path: Path = RESULTS) -> str:
    """The latest row of each benchmark and setup in bench/RESULTS.md, in first-seen order."""
    header: str | None = None
    latest: dict[str, str] = {}
    for line in results_path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or set(cells[0]) <= {"-"}:
            continue
        if cells[0] == "date":
            header = line
            continue
        setup = re.sub(r",? load [0-9.]+", "", cells[2]) if len(cells) > 2 else ""
        latest[f"{cells[1]}|{setup}"] = line  # a dict keeps the first-seen order, the last value
    if header is None:
        raise ReferenceError(f"{results_path.name} has no table header")
    separator = "|" + "---|" * (header.count("|") - 1)
    return "\n".join(
        [BENCH_BEGIN, "", header, separator, *latest.values(), "", BENCH_END]
    )


def rewrite(readme: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """`readme` with the block between the markers replaced by `block`."""
    if readme.count(begin) != 1 or readme.count(end) != 1:
        raise ReferenceError(f"{README.name} must hold the markers {begin!r} and {end!r} once each")
    head, rest = readme.split(begin)
    _, tail = rest.split(end)
    return head + block + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when README.md is not current")
    args = parser.parse_args(argv)
    try:
        readme = README.read_text()
        updated = rewrite(readme, render())
        updated = rewrite(updated, render_bench(), BENCH_BEGIN, BENCH_END)
    except ReferenceError as exc:
        print(f"readme_sections: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if updated != readme:
            print("README.md's generated sections are stale: run "
                  "`python hack/readme_sections.py`", file=sys.stderr)
            return 1
        return 0
    README.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
