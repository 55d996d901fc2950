"""Tensor parallelism in the rendered pod: `--tensor-parallel-size` from resources.gpus or
spec.runtime.tensorParallelSize, a memory-backed /dev/shm, and the spec checks that mirror the
CRD's CEL rule (the API server's side: tests/operator/test_validation.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kubeinfer.operator.manifests import render
from kubeinfer.operator.spec import InvalidSpecError, parse_spec
from tests.operator.conftest import make_model
from tests.operator.test_manifests import CONFIG, arg, by_kind, container


def _spec(gpus: int, tp: int | None = None) -> dict[str, Any]:
    runtime = {} if tp is None else {"tensorParallelSize": tp}
    return {"model": {"uri": "pvc://w"}, "runtime": runtime, "resources": {"gpus": gpus}}


def _rendered(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, runtime container) of the model's Deployment."""
    dep = by_kind(render(make_model(spec), CONFIG))["Deployment"]
    return dep["spec"]["template"]["spec"], container(dep)


@pytest.mark.parametrize(
    ("gpus", "tp", "expected"),
    [
        (4, None, "4"),  # a rank per GPU by default
        (1, None, "1"),
        (0, None, "1"),  # CPU pods: one rank unless asked
        (4, 2, "2"),  # the override wins
        (8, 8, "8"),
        (0, 4, "4"),  # CPU tensor parallel over gloo
    ],
)
def test_tensor_parallel_size_reaches_the_args(gpus: int, tp: int | None, expected: str) -> None:
    _, c = _rendered(_spec(gpus, tp))
    assert c["args"].count("--tensor-parallel-size") == 1
    assert arg(c["args"], "--tensor-parallel-size") == expected
    assert arg(c["args"], "--device") == ("cuda" if gpus else "cpu")


def test_four_gpus_get_four_ranks_and_a_memory_backed_dev_shm() -> None:
    pod, c = _rendered(_spec(4))
    assert arg(c["args"], "--tensor-parallel-size") == "4"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": CONFIG.shm_size}
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "dshm"]
    assert mount == {"name": "dshm", "mountPath": "/dev/shm"}


def test_extra_args_come_after_the_managed_size() -> None:
    spec = _spec(2)
    spec["runtime"]["extraArgs"] = ["--num-kv-blocks", "64"]
    _, c = _rendered(spec)
    assert c["args"][-2:] == ["--num-kv-blocks", "64"]
    assert arg(c["args"], "--tensor-parallel-size") == "2"


@pytest.mark.parametrize(
    ("gpus", "tp", "expected"),
    [(4, None, 4), (0, None, 1), (4, 2, 2), (4, 1, 1), (0, 3, 3), (16, 16, 16)],
)
def test_spec_parses_the_size(gpus: int, tp: int | None, expected: int) -> None:
    parsed = parse_spec(_spec(gpus, tp))
    assert parsed.runtime.tensor_parallel_size == tp
    assert parsed.tensor_parallel_size == expected


def test_unset_resources_mean_one_gpu_and_one_rank() -> None:
    parsed = parse_spec({"model": {"uri": "pvc://w"}})
    assert parsed.runtime.tensor_parallel_size is None
    assert parsed.tensor_parallel_size == 1


@pytest.mark.parametrize(("gpus", "tp"), [(4, 3), (2, 4), (6, 4), (1, 2)])
def test_a_size_that_does_not_divide_the_gpus_is_refused(gpus: int, tp: int) -> None:
    with pytest.raises(InvalidSpecError, match=r"spec\.runtime\.tensorParallelSize .*gpus"):
        parse_spec(_spec(gpus, tp))
    with pytest.raises(InvalidSpecError, match=r"spec\.runtime\.tensorParallelSize"):
        render(make_model(_spec(gpus, tp)), CONFIG)


@pytest.mark.parametrize("tp", [0, -1, 65, "two"])
def test_out_of_range_sizes_are_refused(tp: Any) -> None:
    with pytest.raises(InvalidSpecError, match=r"spec\.runtime\.tensorParallelSize"):
        parse_spec(_spec(0, tp))


@pytest.mark.parametrize("form", [["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"]])
def test_extra_args_may_not_set_the_size(form: list[str]) -> None:
    spec = _spec(2)
    spec["runtime"]["extraArgs"] = form
    with pytest.raises(InvalidSpecError, match="spec.runtime.extraArgs: --tensor-parallel-size"):
        render(make_model(spec), CONFIG)
