"""What the watches show: the latest object of each watched kind, as an informer's cache holds it.

`Store.observe(kind, event_type, body)` records one watch event and returns the key
(namespace, model name) of the model it concerns, the key to reconcile. The store keeps
objects only, no decisions and no per-model state: every question is answered from the objects
at the time it is asked.

- Models by key; children (the kinds of `manifests.CHILDREN`: the watches only show those with
  our labels) by kind, namespace and name, each concerning the model its instance label names
  (the router's children are named `NAME-router`); ReplicaSets and pods by name.
- `child(child_id, key)`: the object of that child's kind and name, whoever owns it;
  `owned_child(child_id, key)`: only when it carries the model's owner reference.
- `owned_pods(key)`: pods whose controller is a ReplicaSet of the model's own Deployment (owner
  references, as the Deployment controller sets them): labels alone can be copied by any pod,
  which would then be counted and have its /ready read. The router's pods (the same instance
  label) likewise, through its own Deployment.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubeinfer.operator.manifests import INSTANCE_LABEL, KIND, child_ref
from kubeinfer.operator.plan import is_owned

Key = tuple[str, str]  # (namespace, model name)


def object_key(obj: Mapping[str, Any]) -> Key:
    meta = obj["metadata"]
    return meta["namespace"], meta["name"]


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")  # type: ignore[no-any-return]
    return None


class Store:
    def __init__(self) -> None:
        self.models: dict[Key, dict[str, Any]] = {}
        self.children: dict[tuple[str, str, str], dict[str, Any]] = {}  # (kind, ns, name)
        self.pods: dict[Key, dict[str, dict[str, Any]]] = {}  # model key -> pod name -> pod
        # (ns, ReplicaSet name) -> (its uid, its controller's uid): pods -> Deployment
        self.replicasets: dict[Key, tuple[str, str | None]] = {}

    def observe(self, kind: str, event_type: str | None, body: Mapping[str, Any]) -> Key | None:
        """Record a watch event; the key of the model it concerns (None: no model's)."""
        ns, name = object_key(body)
        is_gone = event_type == "DELETED"
        if kind == KIND:
            if is_gone:
                self.models.pop((ns, name), None)
            else:
                self.models[(ns, name)] = dict(body)
            return ns, name
        instance = (body["metadata"].get("labels") or {}).get(INSTANCE_LABEL)
        if kind == "Pod":
            if not instance:
                return None
            pods = self.pods.setdefault((ns, instance), {})
            if is_gone:
                pods.pop(name, None)
                if not pods:
                    del self.pods[(ns, instance)]
            else:
                pods[name] = dict(body)
            return ns, instance
        if kind == "ReplicaSet":
            if is_gone:
                self.replicasets.pop((ns, name), None)
            else:
                self.replicasets[(ns, name)] = (
                    body["metadata"].get("uid", ""),
                    controller_uid(body),
                )
            return (ns, instance) if instance else None
        if is_gone:
            self.children.pop((kind, ns, name), None)
        else:
            self.children[(kind, ns, name)] = dict(body)
        return ns, instance or name  # a child has its model's name, or names it in its label

    def child(self, child_id: str, key: Key) -> dict[str, Any] | None:
        """The watched object of the child's kind and name, whoever owns it."""
        kind, name = child_ref(child_id, key[1])
        return self.children.get((kind, key[0], name))

    def owned_child(self, child_id: str, key: Key) -> dict[str, Any] | None:
        """The model's child `child_id`; None when absent or another's."""
        model, child = self.models.get(key), self.child(child_id, key)
        if model is None or child is None or not is_owned(child, model):
            return None
        return child

    def owned_pods(self, key: Key, deployment_id: str = "Deployment") -> dict[str, dict[str, Any]]:
        """The model's pods by name: those a ReplicaSet of its own Deployment controls (of its
        runtime, or with `deployment_id` "RouterDeployment", of its router)."""
        deployment = self.owned_child(deployment_id, key)
        pods = self.pods.get(key, {})
        if deployment is None or not pods:
            return {}
        ns, dep_uid = key[0], deployment["metadata"].get("uid")
        rs_uids = {
            uid
            for (rs_ns, _), (uid, owner) in self.replicasets.items()
            if rs_ns == ns and owner == dep_uid and dep_uid
        }
        return {name: p for name, p in pods.items() if controller_uid(p) in rs_uids}
