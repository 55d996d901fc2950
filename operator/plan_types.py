"""What crosses the reconciler's pure step: the `Snapshot` it reads, the `Plan` it carries out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kubeinfer.operator.manifests import Manifest
from kubeinfer.operator.status import PodView


@dataclass(slots=True, frozen=True)
class Failure:
    reason: str  # the Ready condition's reason: InvalidSpec | NotOwned | APINotInstalled
    message: str


@dataclass(slots=True, frozen=True)
class ChildPlan:
    applies: list[Manifest] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)  # kinds
    failure: Failure | None = None
    wait: str | None = None  # transient: try again soon


@dataclass(slots=True, frozen=True)
class Snapshot:
    """The world as one reconcile of one model sees it."""

    model: Mapping[str, Any]
    #: kind -> the object of the child's name (whoever owns it), None when there is none; a
    #: kind missing here was not read (a new model's first pass reads its Deployment alone)
    children: Mapping[str, Mapping[str, Any] | None]
    #: the model's pods (owner-matched, not terminating), each with its last /ready reading
    pods: Sequence[PodView] = ()
    now: str = ""  # RFC 3339, for conditions that change


@dataclass(slots=True, frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(slots=True, frozen=True)
class Plan:
    """What one reconcile writes, in this order: applies (together), the Deployment's scale,
    deletes, the status, events. Empty when the world is as the model asks."""

    applies: list[Manifest] = field(default_factory=list)
    scale: int | None = None  # the Deployment's replicas through its scale subresource
    deletes: list[str] = field(default_factory=list)  # kinds of owned children no longer wanted
    status: dict[str, Any] | None = None  # the operator's status fields; None: leave as is
    events: list[Event] = field(default_factory=list)
    repairs: list[str] = field(default_factory=list)  # kinds re-applied because they drifted
    failure: Failure | None = None
    requeue_after: float | None = None  # look again this much later (None: on the next event)

    @property
    def num_writes(self) -> int:
        num = len(self.applies) + len(self.deletes) + len(self.events)
        return num + (self.scale is not None) + (self.status is not None)
