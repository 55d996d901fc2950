"""Docs that are generated must be current: the README's InferenceModel reference and its
benchmark summary (hack/readme_sections.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("readme", REPO / "hack/readme_sections.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_readme_reference_is_current() -> None:
    assert _generator().main(["--check"]) == 0, "run `python hack/readme_sections.py`"


def test_reference_lists_every_spec_field_with_default() -> None:
    gen = _generator()
    block = gen.render()
    for field in ("spec.model.uri", "spec.autoscaling.targetPerReplica",
                  "spec.scheduling.tolerations[].effect", "spec.apiKeySecretRef.key"):
        assert f"| {field} |" in block
    assert '| spec.runtime.maxNumSeqs | integer | `256` | >= 1, <= 4096 |' in block
    assert "autoscaling.minReplicas must not exceed autoscaling.maxReplicas" in block


def test_undocumented_spec_field_is_an_error(tmp_path: Path) -> None:
    gen = _generator()
    crd = yaml.safe_load(gen.CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["newField"] = {"type": "integer"}
    path = tmp_path / "crd.yaml"
    path.write_text(yaml.safe_dump(crd))
    with pytest.raises(gen.ReferenceError, match="spec.newField has no description"):
        gen.render(path)


def test_missing_markers_are_named() -> None:
    gen = _generator()
    with pytest.raises(gen.ReferenceError, match="markers"):
        gen.rewrite("# no markers here\n", "x")


def test_bench_summary_keeps_the_latest_row_of_each_bench_and_setup(tmp_path: Path) -> None:
    gen = _generator()
    results = tmp_path / "RESULTS.md"
    results.write_text(
        "# x\n\n| date | bench | setup | ours |\n|---|---|---|---|\n"
        "| d1 | loader | a | 1 |\n| d1 | serve | a | 2 |\n| d2 | loader | a | 3 |\n"
        "| d1 | peer | fp32, load 7.2 | 4 |\n| d1 | peer | bf16 | 5 |\n"
        "| d2 | peer | fp32, load 2.1 | 6 |\n"
    )
    block = gen.render_bench(results)
    assert "| d2 | loader | a | 3 |" in block and "| d1 | serve | a | 2 |" in block
    assert "| d1 | loader | a | 1 |" not in block
    assert block.index("loader") < block.index("serve")
    # one row per setup (the load it ran at aside): fp32's latest and bf16's
    assert "| d2 | peer | fp32, load 2.1 | 6 |" in block and "| d1 | peer | bf16 | 5 |" in block
    assert "| 4 |" not in block
