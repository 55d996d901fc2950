"""OperatorSettings: every setting of `kubeinfer operator run`, from `KUBEINFER_OPERATOR_*` env.

One field per setting; the env var is the field name upper-cased with the prefix
(`KUBEINFER_OPERATOR_RUNTIME_IMAGE`), so a Helm value maps onto each one to one.
"""

from __future__ import annotations

import posixpath
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kubeinfer import __version__


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KUBEINFER_OPERATOR_", extra="forbid")

    runtime_image: str = Field(f"kubeinfer/runtime:{__version__}", min_length=1)
    """Image of the runtime containers when an InferenceModel leaves spec.runtime.image empty."""
    router_image: str = Field(f"kubeinfer/operator:{__version__}", min_length=1)
    """Image of the models' router pods (`kubeinfer router`: the core distribution, no torch,
    which the operator image carries)."""
    downloader_image: str = Field("python:3.12-slim", min_length=1)
    """Image of the init container that downloads hf:// models (needs pip and network)."""
    namespaces: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Namespaces to watch (comma-separated in env); empty: the whole cluster."""
    peering: bool = False
    """Coordinate with other operator replicas through kopf peering (needs kopf's peering
    CRDs); off: this operator runs standalone."""
    peering_name: str = "kubeinfer"
    """The KopfPeering (or ClusterKopfPeering) object the replicas share."""
    priority: int = 0
    """Peering priority: the highest running replica is the active one."""
    leader_election: bool = False
    """Act only while holding a coordination.k8s.io Lease (`leader.py`), so that several
    replicas can run and exactly one acts; the others wait as standbys."""
    leader_election_namespace: str = "default"
    """Namespace of the Lease (the chart: the operator's own)."""
    leader_election_name: str = Field("kubeinfer-operator", min_length=1)
    """Name of the Lease the replicas share."""
    lease_duration_s: int = Field(15, ge=2, le=300)
    """A leader that stops renewing is replaced this long after its last renewal (plus one
    renew interval at most)."""
    lease_renew_s: float = Field(5.0, gt=0)
    """How often the leader renews and standbys try to take the Lease."""
    liveness_host: str = "0.0.0.0"
    liveness_port: int = Field(8080, ge=0, le=65535)
    """kopf's liveness endpoint, http://HOST:PORT/healthz; port 0 turns it off."""
    metrics_host: str = "0.0.0.0"
    metrics_port: int = Field(9090, ge=0, le=65535)
    """The operator's own Prometheus /metrics; port 0 turns it off."""
    pod_probe_interval_s: float = Field(5.0, gt=0)
    """How often the runtime's /ready of pods that are not ready is read (load progress and
    load errors reach the status from there)."""
    pod_probe_timeout_s: float = Field(2.0, gt=0)
    startup_budget_s: int = Field(1800, ge=60)
    """How long a runtime container may take to answer /ready (weights can take
    minutes); the startup probe's periodSeconds x failureThreshold."""
    shutdown_delay_s: int = Field(5, ge=0, le=300)
    """On SIGTERM the runtime keeps serving this long with /ready failing, while the pod leaves
    the endpoints of Services, gateways and routers (`--shutdown-delay`)."""
    drain_timeout_s: int = Field(30, ge=0, le=3600)
    """Then it refuses new requests and finishes those in flight for up to this long
    (`--drain-timeout`). The pods' terminationGracePeriodSeconds is the sum of both plus
    `manifests.GRACE_MARGIN_S`."""
    allow_hostpath: bool = False
    """Serve `hostpath://` model URIs (a folder of the node mounted into the pod: dev clusters
    and single-node setups). Off, such a model goes Failed: anyone who may create an
    InferenceModel could otherwise mount any folder of the node."""
    hostpath_prefixes: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """The absolute folders a `hostpath://` model must lie in (comma-separated in env); with
    `allow_hostpath` on and none given, no hostpath model is served."""
    shm_size: str = "2Gi"
    """Size limit of the /dev/shm emptyDir (medium Memory) of the runtime containers."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("namespaces", mode="before")
    @classmethod
    def _split_namespaces(cls, value: object) -> object:
        if isinstance(value, str):
            return [ns.strip() for ns in value.split(",") if ns.strip()]
        return value

    @field_validator("hostpath_prefixes", mode="before")
    @classmethod
    def _split_prefixes(cls, value: object) -> object:
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value

    @field_validator("hostpath_prefixes")
    @classmethod
    def _absolute_prefixes(cls, prefixes: list[str]) -> list[str]:
        for prefix in prefixes:
            is_normal = posixpath.normpath(prefix) == (prefix.rstrip("/") or "/")
            if not prefix.startswith("/") or not is_normal:
                raise ValueError(f"hostpath prefix {prefix!r} is not a normalized absolute path")
        return [p.rstrip("/") or "/" for p in prefixes]

    @model_validator(mode="after")
    def _renew_within_duration(self) -> OperatorSettings:
        if self.lease_renew_s * 2 > self.lease_duration_s:
            raise ValueError("lease_renew_s must be at most half of lease_duration_s")
        return self

    @property
    def is_clusterwide(self) -> bool:
        return not self.namespaces
