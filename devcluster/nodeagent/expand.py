"""Kubelet-style `$(VAR)` expansion of container commands, args and env values.

Follows the kubelet's rules (k8s.io/kubernetes third_party/forked/golang/expansion): `$(NAME)`
becomes the value of NAME when NAME is defined and stays as written when it is not; `$$` is an
escaped `$`, so `$$(NAME)` yields the literal `$(NAME)`; a `$` followed by anything else, or a
`$(` that never closes, is kept as is. Plain shell syntax such as `$NAME` is never touched.
"""

from __future__ import annotations

from collections.abc import Mapping


def expand(text: str, env: Mapping[str, str]) -> str:
    """Return `text` with every defined `$(NAME)` replaced by `env[NAME]`."""
    out: list[str] = []
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch != "$" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":  # escaped dollar
            out.append("$")
            i += 2
        elif nxt == "(":
            end = text.find(")", i + 2)
            if end < 0:  # unterminated reference: keep the rest verbatim
                out.append(text[i:])
                break
            name = text[i + 2 : end]
            out.append(env[name] if name in env else text[i : end + 1])
            i = end + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def expand_all(items: list[str], env: Mapping[str, str]) -> list[str]:
    """Expand each of `items` (a command or args list)."""
    return [expand(item, env) for item in items]
