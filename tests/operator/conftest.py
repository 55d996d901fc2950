"""Operator test helpers: InferenceModel objects as the API server would store them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "inferencemodels.kubeinfer.dev.yaml"
EXAMPLE_PATH = REPO / "examples" / "smollm2.yaml"


def make_model(spec: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    """An InferenceModel with metadata filled in (uid, namespace, generation)."""
    return {
        "apiVersion": "kubeinfer.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {
            "name": "smollm2",
            "namespace": "models",
            "uid": "1234-abcd",
            "generation": 1,
            **meta,
        },
        "spec": copy.deepcopy(spec) if spec is not None else {"model": {"uri": "pvc://weights"}},
    }


def example_model(
    model_dir: Path | str, namespace: str = "default", *, autoscaling: bool = False
) -> dict[str, Any]:
    """examples/smollm2.yaml with its MODEL_DIR placeholder filled in; without its autoscaling
    block unless asked for (tests that scale by hand need replicas to be theirs)."""
    text = EXAMPLE_PATH.read_text().replace("MODEL_DIR", str(model_dir))
    model = yaml.safe_load(text)
    if not autoscaling:
        model["spec"].pop("autoscaling", None)
    model["metadata"]["namespace"] = namespace
    return model


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())
