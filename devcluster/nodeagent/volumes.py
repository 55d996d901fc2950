"""Make a pod's volumes exist on this machine: hostPath folders as themselves (created for
the *OrCreate types), emptyDir as a per-pod folder, configMap, secret, downwardAPI and projected
volumes as per-pod folders of files (projected service-account tokens included)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubeinfer.devcluster.nodeagent.podspec import KeyLookup, PodContext, PodSpecError, field_ref


def prepare_volumes(pod: dict[str, Any], ctx: PodContext, lookup: KeyLookup, token: str) -> None:
    """Create or fill every volume of `pod`; PodSpecError when one cannot be made."""
    namespace = pod["metadata"].get("namespace", "default")
    for vol in pod["spec"].get("volumes") or []:
        name = vol["name"]
        target = ctx.pod_dir / "volumes" / name
        if "hostPath" in vol:
            _host_path(vol["hostPath"], name)
        elif "emptyDir" in vol:
            target.mkdir(parents=True, exist_ok=True)
        elif "configMap" in vol or "secret" in vol:
            kind, src = (
                ("ConfigMap", vol["configMap"]) if "configMap" in vol else ("Secret", vol["secret"])
            )
            obj_name = src.get("name") or src.get("secretName", "")
            _write_keys(target, kind, namespace, obj_name, src, lookup)
        elif "downwardAPI" in vol:
            _write_downward(target, pod, vol["downwardAPI"].get("items") or [], ctx)
        elif "projected" in vol:
            target.mkdir(parents=True, exist_ok=True)
            for source in vol["projected"].get("sources") or []:
                if "serviceAccountToken" in source:
                    _write(target / source["serviceAccountToken"]["path"], token)
                elif "configMap" in source:
                    src = source["configMap"]
                    _write_keys(target, "ConfigMap", namespace, src["name"], src, lookup)
                elif "secret" in source:
                    src = source["secret"]
                    _write_keys(target, "Secret", namespace, src["name"], src, lookup)
                elif "downwardAPI" in source:
                    _write_downward(target, pod, source["downwardAPI"].get("items") or [], ctx)


def _host_path(spec: dict[str, Any], name: str) -> None:
    path, kind = Path(spec["path"]), spec.get("type") or ""
    if kind == "DirectoryOrCreate":
        path.mkdir(parents=True, exist_ok=True)
    elif kind == "FileOrCreate":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
    elif kind == "Directory" and not path.is_dir():
        raise PodSpecError(
            "CreateContainerConfigError", f"hostPath {path} of {name!r} is no folder"
        )
    elif kind == "File" and not path.is_file():
        raise PodSpecError("CreateContainerConfigError", f"hostPath {path} of {name!r} is no file")


def _write_keys(
    target: Path, kind: str, namespace: str, name: str, src: dict[str, Any], lookup: KeyLookup
) -> None:
    data = lookup(kind, namespace, name)
    if data is None:
        if src.get("optional"):
            return
        raise PodSpecError("CreateContainerConfigError", f"{kind} {name!r} not found")
    items = src.get("items") or [{"key": k, "path": k} for k in data]
    for item in items:
        if item["key"] in data:
            _write(target / item["path"], data[item["key"]])
        elif not src.get("optional"):
            raise PodSpecError(
                "CreateContainerConfigError", f"{kind} {name!r} has no key {item['key']!r}"
            )


def _write_downward(
    target: Path, pod: dict[str, Any], items: list[dict[str, Any]], ctx: PodContext
) -> None:
    for item in items:
        if "fieldRef" in item:
            _write(target / item["path"], field_ref(pod, item["fieldRef"]["fieldPath"], ctx))


def _write(path: Path, content: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
