"""The InferenceModel spec as typed values: parsed from the object the API server stores.

The CRD (`crds/inferencemodels.kubeinfer.dev.yaml`) is the authority on what is valid; the
models here carry the same defaults so that objects from an older CRD, or written by hand in
tests, parse the same way (a test checks that both agree). `parse_spec` raises
`InvalidSpecError` for what the operator cannot serve even when the API server accepted it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kubeinfer.operator.autoscale_types import MetricName


class InvalidSpecError(ValueError):
    """An InferenceModel the operator cannot turn into pods; the message names the field."""


class _Spec(BaseModel):
    # Fields the CRD does not know are pruned by the API server; here they are ignored too.
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class ModelRef(_Spec):
    uri: str
    served_name: str | None = Field(None, alias="servedName")


class EnvVar(_Spec):
    name: str
    value: str | None = None
    value_from: dict[str, Any] | None = Field(None, alias="valueFrom")

    def to_api(self) -> dict[str, Any]:
        if self.value_from is not None:
            return {"name": self.name, "valueFrom": self.value_from}
        return {"name": self.name, "value": self.value or ""}


class RuntimeSpec(_Spec):
    image: str = ""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: int = Field(4096, alias="maxModelLen", ge=16)
    max_num_seqs: int = Field(256, alias="maxNumSeqs", ge=1)
    max_num_batched_tokens: int = Field(8192, alias="maxNumBatchedTokens", ge=16)
    kv_cache_memory_fraction: float = Field(0.9, alias="kvCacheMemoryFraction", gt=0, le=1)
    enable_prefix_caching: bool = Field(True, alias="enablePrefixCaching")
    extra_args: list[str] = Field(default_factory=list, alias="extraArgs")
    env: list[EnvVar] = Field(default_factory=list)
    #: ranks (one worker process each) one replica's model is split across; None: one per GPU
    #: (resources.gpus), 1 on CPU. It must divide resources.gpus when there are GPUs.
    tensor_parallel_size: int | None = Field(None, alias="tensorParallelSize", ge=1, le=64)


class ResourcesSpec(_Spec):
    gpus: int = Field(1, ge=0)
    gpu_resource_name: str = Field("nvidia.com/gpu", alias="gpuResourceName")
    cpu: str | int = "4"
    memory: str | int = "32Gi"


class SchedulingSpec(_Spec):
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict)
    priority_class_name: str = Field("", alias="priorityClassName")
    runtime_class_name: str = Field("", alias="runtimeClassName")


class AdditionalMetric(_Spec):
    metric: MetricName
    target_per_replica: float = Field(alias="targetPerReplica", gt=0)


class AutoscalingSpec(_Spec):
    enabled: bool = False
    min_replicas: int = Field(1, alias="minReplicas", ge=0)
    max_replicas: int = Field(4, alias="maxReplicas", ge=1)
    metric: MetricName = "generationTokensPerSecond"
    target_per_replica: float = Field(1000.0, alias="targetPerReplica", gt=0)
    additional_metrics: list[AdditionalMetric] = Field(
        default_factory=list, alias="additionalMetrics", max_length=4
    )
    stable_window_seconds: int = Field(60, alias="stableWindowSeconds", ge=1)
    panic_window_seconds: int = Field(6, alias="panicWindowSeconds", ge=1)
    scale_down_delay_seconds: int = Field(300, alias="scaleDownDelaySeconds", ge=0)
    scrape_interval_seconds: int = Field(5, alias="scrapeIntervalSeconds", ge=1)
    #: with minReplicas 0: this long without a request at the router scales to zero (the CRD
    #: has no default, so that CEL can refuse it beside minReplicas above 0)
    scale_to_zero_after_seconds: int = Field(
        300, alias="scaleToZeroAfterSeconds", ge=0, le=86400
    )


IntOrPercent = int | str


def _is_zero(value: IntOrPercent) -> bool:
    return str(value) in ("0", "0%")


class RolloutSpec(_Spec):
    """spec.rollout: the Deployment's RollingUpdate bounds (the CRD checks their form)."""

    max_surge: IntOrPercent = Field(1, alias="maxSurge")
    max_unavailable: IntOrPercent = Field(0, alias="maxUnavailable")


RoutingMode = Literal["router", "service", "inferencePool"]


class EndpointPickerRef(_Spec):
    """spec.routing.endpointPicker: the Service of the endpoint picker (EPP) a gateway asks
    where to send each request of the model's InferencePool (mode inferencePool)."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    port: int = Field(9002, ge=1, le=65535)


class RoutingSpec(_Spec):
    """spec.routing: what the model's endpoint (its Service) points at.

    `router`: the model's own `kubeinfer router` pods (prefix affinity, load, holding requests
    while no replica is ready); `service`: the runtime pods directly (connection round robin);
    `inferencePool`: the runtime pods directly plus an InferencePool for a Gateway API
    Inference Extension gateway."""

    mode: RoutingMode = "router"
    replicas: int = Field(1, ge=1, le=16)
    endpoint_picker: EndpointPickerRef | None = Field(None, alias="endpointPicker")
    max_held_requests: int = Field(256, alias="maxHeldRequests", ge=0, le=100_000)
    max_hold_seconds: int = Field(300, alias="maxHoldSeconds", ge=1, le=3600)


class SecretKeyRef(_Spec):
    name: str = ""
    key: str = ""

    @property
    def is_set(self) -> bool:
        return bool(self.name and self.key)


class InferenceModelSpec(_Spec):
    model: ModelRef
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    replicas: int = Field(1, ge=0)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    api_key_secret_ref: SecretKeyRef = Field(default_factory=SecretKeyRef, alias="apiKeySecretRef")

    @property
    def tensor_parallel_size(self) -> int:
        """The ranks `kubeinfer serve --tensor-parallel-size` gets: spec.runtime's when set,
        else one per GPU of resources.gpus, else (a CPU pod) 1."""
        if self.runtime.tensor_parallel_size is not None:
            return self.runtime.tensor_parallel_size
        return max(1, self.resources.gpus)


@dataclass(slots=True, frozen=True)
class ModelSource:
    """Where the weights come from, parsed from spec.model.uri."""

    scheme: Literal["pvc", "hostpath", "hf"]
    claim: str = ""  # pvc: the PersistentVolumeClaim
    path: str = ""  # pvc: the folder inside the claim ("" is its root); hostpath: absolute path
    repo: str = ""  # hf: ORG/NAME
    revision: str = ""  # hf: a branch, tag or commit ("" is the default branch)


_PVC = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9.]*[a-z0-9])?)(?P<path>(/[^/]+)*)/?$")
_HOSTPATH = re.compile(r"^hostpath://(?P<path>/[^/].*)$")
_HF = re.compile(
    r"^hf://(?P<repo>[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*)(@(?P<rev>[-\w./]+))?$"
)


def parse_model_uri(uri: str) -> ModelSource:
    """spec.model.uri -> ModelSource; InvalidSpecError names what is wrong."""
    if "/../" in uri or uri.endswith("/.."):
        raise InvalidSpecError(f"spec.model.uri {uri!r} must not contain '..' segments")
    if "$(" in uri:  # the path reaches the container's args, where Kubernetes expands $(VAR)
        raise InvalidSpecError(f"spec.model.uri {uri!r} must not contain '$('")
    if match := _PVC.match(uri):
        return ModelSource("pvc", claim=match["claim"], path=match["path"].strip("/"))
    if match := _HOSTPATH.match(uri):
        path = match["path"].rstrip("/") or "/"
        if any(part in ("", ".", "..") for part in path.split("/")[1:]):
            raise InvalidSpecError(
                f"spec.model.uri {uri!r}: a hostpath:// path has no '.', '..' or empty segments"
            )
        return ModelSource("hostpath", path=path)
    if match := _HF.match(uri):
        return ModelSource("hf", repo=match["repo"], revision=match["rev"] or "")
    raise InvalidSpecError(
        f"spec.model.uri {uri!r} is not pvc://CLAIM[/PATH], hostpath:///abs/path or hf://ORG/NAME"
    )


def check_hostpath(source: ModelSource, *, is_allowed: bool, prefixes: list[str]) -> None:
    """InvalidSpecError unless a hostpath source is allowed and lies under one of `prefixes`
    (normalized absolute folders); other schemes always pass."""
    if source.scheme != "hostpath":
        return
    if not is_allowed:
        raise InvalidSpecError(
            "spec.model.uri: hostpath:// models are turned off in this operator's settings "
            "(KUBEINFER_OPERATOR_ALLOW_HOSTPATH); use pvc:// or hf://"
        )
    for prefix in prefixes:
        if prefix == "/" or source.path == prefix or source.path.startswith(prefix + "/"):
            return
    allowed = ", ".join(prefixes) or "none configured"
    raise InvalidSpecError(
        f"spec.model.uri: hostpath {source.path} is not under an allowed folder ({allowed})"
    )


def parse_spec(spec: Mapping[str, Any]) -> InferenceModelSpec:
    """The typed spec; InvalidSpecError (naming the field) when it does not parse."""
    try:
        parsed = InferenceModelSpec.model_validate(dict(spec))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidSpecError(f"spec.{where}: {first['msg']}") from exc
    parse_model_uri(parsed.model.uri)
    rollout = parsed.rollout
    for field_name, value in (
        ("maxSurge", rollout.max_surge),
        ("maxUnavailable", rollout.max_unavailable),
    ):
        if isinstance(value, str) and not re.fullmatch(r"[0-9]{1,3}%", value):
            raise InvalidSpecError(
                f"spec.rollout.{field_name}: {value!r} is not a count or a percentage"
            )
        if isinstance(value, int) and value < 0:
            raise InvalidSpecError(f"spec.rollout.{field_name} must not be negative")
    if _is_zero(rollout.max_surge) and _is_zero(rollout.max_unavailable):
        raise InvalidSpecError("spec.rollout.maxSurge and maxUnavailable cannot both be 0")
    if parsed.autoscaling.min_replicas > parsed.autoscaling.max_replicas:
        raise InvalidSpecError("spec.autoscaling.minReplicas must not exceed maxReplicas")
    if (
        parsed.autoscaling.enabled
        and parsed.autoscaling.min_replicas == 0
        and parsed.routing.mode != "router"
    ):
        raise InvalidSpecError(
            "spec.autoscaling.minReplicas 0 needs spec.routing.mode router (the router holds "
            "requests while no replica runs, and its held demand scales the model from zero)"
        )
    check_tensor_parallel(parsed)
    names = [parsed.autoscaling.metric] + [m.metric for m in parsed.autoscaling.additional_metrics]
    if len(set(names)) != len(names):
        raise InvalidSpecError(
            "spec.autoscaling.additionalMetrics must name each metric once, and not "
            "autoscaling.metric"
        )
    return parsed


def check_tensor_parallel(spec: InferenceModelSpec) -> None:
    """InvalidSpecError unless spec.runtime.tensorParallelSize divides resources.gpus (GPU
    pods: every rank takes a whole GPU, and the pod holds whole groups of ranks); on CPU (gpus
    0) any size goes, the ranks then talking over gloo. The CRD refuses the same with CEL."""
    tp, gpus = spec.runtime.tensor_parallel_size, spec.resources.gpus
    if tp is not None and gpus > 0 and gpus % tp != 0:
        raise InvalidSpecError(
            f"spec.runtime.tensorParallelSize {tp} must divide spec.resources.gpus {gpus} "
            "(each tensor-parallel rank takes one whole GPU)"
        )
