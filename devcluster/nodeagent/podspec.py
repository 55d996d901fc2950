"""From a pod (as its JSON dict) to the local process that stands in for each container (pure).

A container becomes a process: its image picks a local environment (the working tree's venv or
the machine's Python; any other image is refused), its env is resolved like the kubelet does
(downward API, ConfigMap/Secret keys, `$(VAR)` expansion) and its volume mounts become real
paths: a mount path that appears in the command, args, env or working directory is rewritten
to the folder that backs it (a hostPath's own path, or a per-pod folder for emptyDir,
configMap, secret and projected volumes).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubeinfer.devcluster.config import ImageMapping
from kubeinfer.devcluster.nodeagent.expand import expand, expand_all

Pod = dict[str, Any]
Container = dict[str, Any]
#: lookup(kind, namespace, name) -> the object's data, or None when it does not exist;
#: kind is "ConfigMap" or "Secret" (Secret values come back decoded).
KeyLookup = Callable[[str, str, str], dict[str, str] | None]

#: Variables of the agent's own environment that every container inherits.
INHERITED_ENV = ("HOME", "LANG", "LC_ALL", "TMPDIR", "TZ", "USER")


class PodSpecError(ValueError):
    """A pod asks for something the dev node agent cannot do; `reason` is the waiting reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(slots=True)
class PodContext:
    """What the agent knows about a pod beyond its spec."""

    pod_ip: str
    host_ip: str
    api_host: str
    api_port: int
    pod_dir: Path  # per-pod files: kubeconfig, emptyDirs, projected volumes
    kubeconfig: Path | None  # None: automountServiceAccountToken is false
    venv_bin: Path
    agent_path: str = field(default_factory=lambda: os.environ.get("PATH", "/usr/bin:/bin"))


@dataclass(slots=True)
class LaunchSpec:
    """How to start one container's process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path


def resolve_image(image: str, mappings: list[ImageMapping]) -> ImageMapping:
    """The mapping whose prefix is the longest match for `image`, or PodSpecError."""
    matches = [m for m in mappings if image.startswith(m.prefix)]
    if not matches:
        known = ", ".join(f"{m.prefix}*" for m in mappings)
        raise PodSpecError(
            "ImageNotMapped",
            f"image {image!r} has no local mapping in the dev node agent (known: {known})",
        )
    return max(matches, key=lambda m: len(m.prefix))


def volume_paths(pod: Pod, pod_dir: Path) -> dict[str, Path]:
    """Volume name -> the real folder (or file) that backs it on this machine."""
    paths: dict[str, Path] = {}
    for vol in pod.get("spec", {}).get("volumes") or []:
        name = vol["name"]
        if "hostPath" in vol:
            paths[name] = Path(vol["hostPath"]["path"])
        elif any(k in vol for k in ("emptyDir", "configMap", "secret", "projected", "downwardAPI")):
            paths[name] = pod_dir / "volumes" / name
        else:
            kinds = sorted(k for k in vol if k != "name")
            raise PodSpecError(
                "VolumeNotSupported",
                f"volume {name!r} ({', '.join(kinds)}) is not supported by the dev node agent",
            )
    return paths


def mount_rewrites(container: Container, volumes: Mapping[str, Path]) -> list[tuple[str, str]]:
    """(mountPath, real path) pairs for the container's mounts, longest mount path first."""
    rewrites = []
    for mount in container.get("volumeMounts") or []:
        real = volumes.get(mount["name"])
        if real is None:
            raise PodSpecError(
                "CreateContainerConfigError", f"volumeMount {mount['name']!r} names no volume"
            )
        if sub := mount.get("subPath"):
            real = real / sub
        rewrites.append((mount["mountPath"].rstrip("/") or "/", str(real)))
    return sorted(rewrites, key=lambda pair: len(pair[0]), reverse=True)


def rewrite_paths(text: str, rewrites: list[tuple[str, str]]) -> str:
    """Replace each mount path in `text` that stands as a path (not inside a longer word), in
    one pass: a replacement is never scanned again (a real path under /tmp stays as it is when
    /tmp is a mount too). Longer mount paths win, as `mount_rewrites` orders them."""
    if not rewrites:
        return text
    real_of = dict(rewrites)
    paths = "|".join(re.escape(mount_path) for mount_path, _ in rewrites)
    pattern = r"(?<![\w./-])(" + paths + r")(?=/|$|[^\w.-])"
    return re.sub(pattern, lambda m: real_of[m.group(1)], text)


def field_ref(pod: Pod, path: str, ctx: PodContext) -> str:
    """The downward API's `fieldRef.fieldPath` values."""
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", "default"),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.hostIP": ctx.host_ip,
        "status.hostIPs": ctx.host_ip,
        "status.podIP": ctx.pod_ip,
        "status.podIPs": ctx.pod_ip,
    }
    if path in simple:
        return simple[path]
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    raise PodSpecError("CreateContainerConfigError", f"fieldRef {path!r} is not supported")


def resource_field_ref(container: Container, ref: dict[str, Any]) -> str:
    """`resourceFieldRef` as the kubelet resolves it: `requests.X` is the request (else the
    limit), `limits.X` the limit (else this machine's CPUs for cpu, 0 otherwise: the node's
    allocatable), over the divisor, rounded up."""
    from kubernetes.utils.quantity import parse_quantity

    kind, _, resource = ref["resource"].partition(".")
    resources = container.get("resources") or {}
    limit = (resources.get("limits") or {}).get(resource)
    request = (resources.get("requests") or {}).get(resource)
    value = (request or limit) if kind == "requests" else limit
    if value is None and kind == "limits" and resource == "cpu":
        value = str(os.cpu_count() or 1)
    if value is None:
        return "0"
    divisor = parse_quantity(ref.get("divisor") or "1")
    return str(math.ceil(parse_quantity(value) / divisor))


def container_env(
    pod: Pod, container: Container, ctx: PodContext, mapping: ImageMapping, lookup: KeyLookup
) -> dict[str, str]:
    """The process environment: base variables, then the container's, in order, each expanded
    against those before it (as the kubelet does)."""
    env = base_env(pod, ctx, mapping)
    return _with_container_env(env, pod, container, ctx, lookup)


def base_env(pod: Pod, ctx: PodContext, mapping: ImageMapping) -> dict[str, str]:
    """What the agent itself sets: host paths (PATH, VIRTUAL_ENV, KUBECONFIG) and API address;
    they point into this machine, never into the pod's mounts, so mounts do not rewrite them."""
    env: dict[str, str] = {k: os.environ[k] for k in INHERITED_ENV if k in os.environ}
    system_path = ":".join(p for p in ctx.agent_path.split(":") if p and Path(p) != ctx.venv_bin)
    if mapping.environment == "venv":
        env["PATH"] = f"{ctx.venv_bin}:{system_path}"
        env["VIRTUAL_ENV"] = str(ctx.venv_bin.parent)
        # The CPU kernels this node already built, as an image would carry them: without it
        # every runtime pod (its HOME an emptyDir) compiles them again, all at once on a rollout.
        env["KUBEINFER_CACHE"] = os.environ.get("KUBEINFER_CACHE") or str(
            Path.home() / ".cache" / "kubeinfer"
        )
    else:
        env["PATH"] = system_path
    env.update(
        HOSTNAME=pod["metadata"]["name"],
        PYTHONUNBUFFERED="1",  # logs reach the log file as they are written
        KUBERNETES_SERVICE_HOST=ctx.api_host,  # never the ClusterIP: nothing routes to it here
        KUBERNETES_SERVICE_PORT=str(ctx.api_port),
        KUBERNETES_PORT=f"tcp://{ctx.api_host}:{ctx.api_port}",
    )
    if ctx.kubeconfig is not None:
        env["KUBECONFIG"] = str(ctx.kubeconfig)
    return env


def _with_container_env(
    env: dict[str, str], pod: Pod, container: Container, ctx: PodContext, lookup: KeyLookup
) -> dict[str, str]:
    namespace = pod.get("metadata", {}).get("namespace", "default")
    env = dict(env)
    for source in container.get("envFrom") or []:
        env.update(_env_from(source, namespace, lookup))
    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var:
            env[name] = expand(var["value"] or "", env)
        elif "valueFrom" in var:
            value = _value_from(pod, container, var["valueFrom"], ctx, namespace, lookup)
            if value is not None:
                env[name] = value
        else:
            env[name] = ""
    return env


def _value_from(
    pod: Pod,
    container: Container,
    source: dict[str, Any],
    ctx: PodContext,
    namespace: str,
    lookup: KeyLookup,
) -> str | None:
    if "fieldRef" in source:
        return field_ref(pod, source["fieldRef"]["fieldPath"], ctx)
    if "resourceFieldRef" in source:
        return resource_field_ref(container, source["resourceFieldRef"])
    for kind, key in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
        if key in source:
            ref = source[key]
            data = lookup(kind, namespace, ref["name"]) or {}
            value = data.get(ref["key"])
            if value is None and not ref.get("optional"):
                raise PodSpecError(
                    "CreateContainerConfigError",
                    f"{kind.lower()} {ref['name']!r} has no key {ref['key']!r}",
                )
            return value
    raise PodSpecError(
        "CreateContainerConfigError", f"env valueFrom {sorted(source)} not supported"
    )


def _env_from(source: dict[str, Any], namespace: str, lookup: KeyLookup) -> dict[str, str]:
    prefix = source.get("prefix", "")
    for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
        if key in source:
            ref = source[key]
            data = lookup(kind, namespace, ref["name"])
            if data is None:
                if ref.get("optional"):
                    return {}
                raise PodSpecError(
                    "CreateContainerConfigError", f"{kind} {ref['name']!r} not found"
                )
            return {prefix + k: v for k, v in data.items()}
    return {}


def launch_spec(
    pod: Pod,
    container: Container,
    ctx: PodContext,
    mappings: list[ImageMapping],
    lookup: KeyLookup,
) -> LaunchSpec:
    """Everything needed to start `container` of `pod` as a local process."""
    mapping = resolve_image(container.get("image", ""), mappings)
    rewrites = mount_rewrites(container, volume_paths(pod, ctx.pod_dir))
    base = base_env(pod, ctx, mapping)
    env = {  # the pod's own values see its mounts; the agent's host paths stay as they are
        k: v if base.get(k) == v else rewrite_paths(v, rewrites)
        for k, v in _with_container_env(base, pod, container, ctx, lookup).items()
    }
    command = container.get("command") or list(mapping.entrypoint)
    argv = expand_all([*command, *(container.get("args") or [])], env)
    argv = [rewrite_paths(a, rewrites) for a in argv]
    if not argv:
        raise PodSpecError(
            "CreateContainerConfigError",
            f"container {container['name']!r} has no command and {mapping.prefix}* no entrypoint",
        )
    working_dir = container.get("workingDir")
    cwd = Path(rewrite_paths(working_dir, rewrites)) if working_dir else ctx.pod_dir
    return LaunchSpec(name=container["name"], argv=argv, env=env, cwd=cwd)
