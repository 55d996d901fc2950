"""Safe by default, without a cluster: hostpath:// only when the settings allow it and under
their prefixes, no '$(' in model URIs, no managed flag or variable in extraArgs/env, and the
CRD's CEL rules in step with the operator's lists."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kubeinfer.operator.manifests import MANAGED_ENV, MANAGED_FLAGS, render
from kubeinfer.operator.settings import OperatorSettings
from kubeinfer.operator.spec import InvalidSpecError, parse_model_uri
from tests.operator.conftest import make_model

DEV = OperatorSettings(allow_hostpath=True, hostpath_prefixes=["/srv/models", "/data/m"])


def _hostpath(uri: str) -> dict[str, Any]:
    return make_model({"model": {"uri": uri}})


def test_hostpath_is_refused_by_default() -> None:
    assert not OperatorSettings().allow_hostpath
    with pytest.raises(InvalidSpecError, match="hostpath:// models are turned off"):
        render(_hostpath("hostpath:///srv/models/smollm2"), OperatorSettings())


@pytest.mark.parametrize("uri", ["hostpath:///srv/models/smollm2", "hostpath:///data/m"])
def test_hostpath_under_a_prefix_is_served(uri: str) -> None:
    assert render(_hostpath(uri), DEV)[0]["kind"] == "Deployment"


@pytest.mark.parametrize(
    "uri",
    [
        "hostpath:///etc",
        "hostpath:///srv/modelsX/a",  # a prefix is a folder, not a string prefix
        "hostpath:///data/mm",
        "hostpath:///srv",
    ],
)
def test_hostpath_outside_the_prefixes_is_refused(uri: str) -> None:
    with pytest.raises(InvalidSpecError, match="not under an allowed folder"):
        render(_hostpath(uri), DEV)


def test_allowed_without_prefixes_serves_nothing() -> None:
    with pytest.raises(InvalidSpecError, match="none configured"):
        render(_hostpath("hostpath:///srv/models/a"), OperatorSettings(allow_hostpath=True))


@pytest.mark.parametrize(
    "uri",
    [
        "hostpath:///.",  # the node's root
        "hostpath:///srv/models/.",
        "hostpath:///srv/models/./../../etc",
        "hostpath:///srv/models/..",
        "hostpath:///srv/models//x",
        "pvc://claim/$(HOME)",
        "hostpath:///srv/models/$(POD_NAME)",
    ],
)
def test_path_tricks_are_refused(uri: str) -> None:
    with pytest.raises(InvalidSpecError, match="spec.model.uri"):
        parse_model_uri(uri)
    with pytest.raises(InvalidSpecError, match="spec.model.uri"):
        render(_hostpath(uri), DEV)


def test_prefix_settings_are_checked_and_split() -> None:
    s = OperatorSettings(hostpath_prefixes="/a/b/, /c")  # type: ignore[arg-type]
    assert s.hostpath_prefixes == ["/a/b", "/c"]
    for bad in ("relative", "/a/../b", "/a/./b"):
        with pytest.raises(ValueError, match="hostpath prefix"):
            OperatorSettings(hostpath_prefixes=[bad])


@pytest.mark.parametrize("flag", MANAGED_FLAGS)
@pytest.mark.parametrize("form", ["separate", "equals"])
def test_extra_args_may_not_set_a_managed_flag(flag: str, form: str) -> None:
    extra = [flag, "x"] if form == "separate" else [f"{flag}=x"]
    spec = {"model": {"uri": "pvc://w"}, "runtime": {"extraArgs": ["--device", "cpu", *extra]}}
    with pytest.raises(InvalidSpecError, match=f"spec.runtime.extraArgs: {flag} "):
        render(make_model(spec), DEV)


@pytest.mark.parametrize("name", MANAGED_ENV)
def test_env_may_not_set_a_managed_variable(name: str) -> None:
    spec = {"model": {"uri": "pvc://w"}, "runtime": {"env": [{"name": name, "value": "x"}]}}
    with pytest.raises(InvalidSpecError, match=f"spec.runtime.env: {name} "):
        render(make_model(spec), DEV)


def test_the_managed_lists_cover_the_contract() -> None:
    for flag in ("--host", "--port", "--api-key", "--model", "--probe-port"):
        assert flag in MANAGED_FLAGS
    assert "--metrics-fault-file" in MANAGED_FLAGS  # the runtime's test hook
    assert {"POD_IP", "KUBEINFER_API_KEY", "KUBEINFER_HOST"} <= set(MANAGED_ENV)


def _rules(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [v["rule"] for v in node.get("x-kubernetes-validations", [])]
        return own + [r for v in node.values() for r in _rules(v)]
    if isinstance(node, list):
        return [r for v in node for r in _rules(v)]
    return []


def test_crd_rules_name_exactly_the_managed_flags_and_env(crd: dict[str, Any]) -> None:
    runtime = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["runtime"]["properties"]
    (args_rule,) = _rules(runtime["extraArgs"])
    alternation = re.search(r"\^--\(([^)]*)\)", args_rule)
    assert alternation is not None
    assert {f"--{f}" for f in alternation[1].split("|")} == set(MANAGED_FLAGS)
    env_rules = [r for r in _rules(runtime["env"]) if " in [" in r]
    (env_rule,) = env_rules
    assert set(re.findall(r"'([A-Z_]+)'", env_rule)) == set(MANAGED_ENV)


def test_helm_chart_carries_the_same_crd() -> None:
    from tests.operator.conftest import CRD_PATH, REPO

    chart_crd = REPO / "helm" / "kubeinfer" / "crds" / CRD_PATH.name
    assert chart_crd.read_text() == CRD_PATH.read_text()
