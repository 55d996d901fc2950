"""The CRD and the operator's spec models agree; model URIs parse; the registry is wired."""

from __future__ import annotations

from typing import Any

import pytest

from kubeinfer.operator.autoscale_daemon import autoscale_daemon
from kubeinfer.operator.handlers import build_registry
from kubeinfer.operator.settings import OperatorSettings
from kubeinfer.operator.spec import (
    InferenceModelSpec,
    InvalidSpecError,
    ModelSource,
    parse_model_uri,
    parse_spec,
)


def _version(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return version


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    return _version(crd)["schema"]["openAPIV3Schema"]


def _crd_defaults(schema: dict[str, Any]) -> dict[str, Any]:
    """The object the API server makes of `{}` under `schema` (nested defaults applied)."""
    out: dict[str, Any] = {}
    for name, prop in (schema.get("properties") or {}).items():
        if prop.get("type") == "object" and "properties" in prop and "default" in prop:
            out[name] = {**prop["default"], **_crd_defaults(prop)}
        elif "default" in prop:
            out[name] = prop["default"]
    return out


def test_crd_names_subresources_and_columns(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert (spec["group"], spec["scope"]) == ("kubeinfer.dev", "Namespaced")
    assert spec["names"]["plural"] == "inferencemodels"
    assert spec["names"]["shortNames"] == ["im"]
    version = _version(crd)
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Model", "Replicas", "Ready", "Tokens/s", "Phase", "Endpoint", "Age"]


def test_pydantic_defaults_match_the_crd(crd: dict[str, Any]) -> None:
    spec_schema = _schema(crd)["properties"]["spec"]
    from_crd = _crd_defaults(spec_schema)
    parsed = InferenceModelSpec.model_validate({"model": {"uri": "pvc://w"}})
    from_model = parsed.model_dump(by_alias=True, exclude={"model", "api_key_secret_ref"})
    for section, values in from_crd.items():
        if isinstance(values, dict):
            for key, value in values.items():
                assert from_model[section][key] == value, f"spec.{section}.{key}"
        else:
            assert from_model[section] == values, f"spec.{section}"


def test_every_status_field_the_operator_writes_is_declared(crd: dict[str, Any]) -> None:
    from kubeinfer.operator.status import OWNED_FIELDS

    declared = set(_schema(crd)["properties"]["status"]["properties"])
    assert set(OWNED_FIELDS) | {"conditions"} <= declared
    # and the autoscaler's
    assert {"metrics", "scalingHistory", "lastScaleTime", "desiredReplicas"} <= declared


@pytest.mark.parametrize(
    ("uri", "source"),
    [
        ("pvc://models", ModelSource("pvc", claim="models")),
        ("pvc://models/smollm2-135m", ModelSource("pvc", claim="models", path="smollm2-135m")),
        ("pvc://models/a/b/", ModelSource("pvc", claim="models", path="a/b")),
        ("hostpath:///data/smollm2", ModelSource("hostpath", path="/data/smollm2")),
        ("hf://org/name", ModelSource("hf", repo="org/name")),
        ("hf://org/name@v1.0", ModelSource("hf", repo="org/name", revision="v1.0")),
    ],
)
def test_model_uris(uri: str, source: ModelSource) -> None:
    assert parse_model_uri(uri) == source


@pytest.mark.parametrize(
    "uri",
    ["s3://b/m", "pvc://", "pvc://Caps", "hostpath://relative", "hf://justname", "pvc://a/../b"],
)
def test_bad_model_uris(uri: str) -> None:
    with pytest.raises(InvalidSpecError, match="spec.model.uri"):
        parse_model_uri(uri)


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBEINFER_OPERATOR_NAMESPACES", "a, b")
    monkeypatch.setenv("KUBEINFER_OPERATOR_RUNTIME_IMAGE", "kubeinfer/runtime:dev")
    monkeypatch.setenv("KUBEINFER_OPERATOR_PEERING", "true")
    s = OperatorSettings()
    assert s.namespaces == ["a", "b"] and not s.is_clusterwide
    assert s.runtime_image == "kubeinfer/runtime:dev" and s.peering


def test_registry_wires_models_children_and_the_autoscaler() -> None:
    registry = build_registry(OperatorSettings())
    spawning = registry._spawning.get_all_handlers()  # noqa: SLF001 - no public listing
    assert any(h.fn is autoscale_daemon for h in spawning)
    watched = {h.selector.any_name for h in registry._watching.get_all_handlers()}  # noqa: SLF001
    assert {"inferencemodels", "deployments", "services", "poddisruptionbudgets", "replicasets",
            "pods"} <= watched  # fmt: skip
    # handlers only queue keys: no create/update/resume handler (and no annotations kopf
    # would write for them); only the daemon makes kopf add a finalizer
    assert registry._changing.get_all_handlers() == []  # noqa: SLF001


def test_additional_metrics_share_the_metric_enum_and_key_on_it(crd: dict[str, Any]) -> None:
    autoscaling = _schema(crd)["properties"]["spec"]["properties"]["autoscaling"]["properties"]
    extra = autoscaling["additionalMetrics"]
    assert extra["x-kubernetes-list-type"] == "map"
    assert extra["x-kubernetes-list-map-keys"] == ["metric"]
    assert extra["items"]["properties"]["metric"]["enum"] == autoscaling["metric"]["enum"]


def test_additional_metrics_parse_and_may_not_repeat_a_metric() -> None:
    waiting = {"metric": "requestsWaiting", "targetPerReplica": 4}
    spec = parse_spec(
        {"model": {"uri": "pvc://w"}, "autoscaling": {"additionalMetrics": [waiting]}}
    )
    (metric,) = spec.autoscaling.additional_metrics
    assert (metric.metric, metric.target_per_replica) == ("requestsWaiting", 4.0)
    for repeated in ([waiting, waiting], [{**waiting, "metric": "generationTokensPerSecond"}]):
        body = {"model": {"uri": "pvc://w"}, "autoscaling": {"additionalMetrics": repeated}}
        with pytest.raises(InvalidSpecError, match="spec.autoscaling.additionalMetrics"):
            parse_spec(body)
