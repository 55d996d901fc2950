"""Has a child drifted from what the operator applied? (pure)

`first_difference(desired, actual)` compares a rendered manifest with the live object as a
subset: every field the operator sets must be there with the same value, while fields the API
server or controllers add (defaults, status, managed fields) are ignored. Lists must match in
length, element by element, so an argument appended by hand counts as drift.
"""

from __future__ import annotations

from typing import Any

#: Parts of the live object that are never the operator's to compare.
_IGNORED_TOP = ("status",)
_IGNORED_META = ("resourceVersion", "uid", "generation", "creationTimestamp", "managedFields")


def first_difference(desired: Any, actual: Any, path: str = "") -> str | None:
    """The path of the first field of `desired` that `actual` lacks or holds differently."""
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            return path or "."
        for key, want in desired.items():
            if not path and key in _IGNORED_TOP:
                continue
            if path == ".metadata" and key in _IGNORED_META:
                continue
            where = f"{path}.{key}"
            if key not in actual:
                if want in ({}, [], None, ""):
                    continue  # an empty value the API server drops on write
                return where
            if (diff := first_difference(want, actual[key], where)) is not None:
                return diff
        return None
    if isinstance(desired, list):
        if not isinstance(actual, list) or len(desired) != len(actual):
            return path
        for i, (want, have) in enumerate(zip(desired, actual, strict=True)):
            if (diff := first_difference(want, have, f"{path}[{i}]")) is not None:
                return diff
        return None
    if (
        isinstance(desired, (int, float))
        and isinstance(actual, str)
        and not isinstance(desired, bool)
    ):
        return None if str(desired) == actual else path
    return None if desired == actual else path
