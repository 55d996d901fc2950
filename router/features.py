"""request_features(path, body, ...) -> RequestFeatures: what routing reads from a request. Pure.

The body is parsed as JSON once and only `prompt` (completions) or `messages` (chat) is read;
a body that is not JSON, or not the expected shape, gets no prefix key (the pod answers its
error, unchanged). Prompt text never leaves this module: it becomes a digest.

The prefix key is blake2b of the prompt's first `prefix_chars` characters; a shorter prompt has
none (it shares less than a few KV blocks with anything, so load decides). A token-id prompt
counts 4 characters per token. A chat request is keyed on its messages rendered as
`role \\x1f content \\x1e ...`: the same system prompt and history give the same leading
characters whatever chat template the pod applies, so every turn of a conversation whose first
`prefix_chars` characters match lands with its predecessors.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kubeinfer.router.routing_types import RequestFeatures

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
#: Characters per token when a prompt comes as token ids.
CHARS_PER_TOKEN = 4


def _leading(text: str, prefix_chars: int) -> str | None:
    return text[:prefix_chars] if len(text) >= prefix_chars else None


def _completion_prefix(prompt: Any, prefix_chars: int) -> str | None:
    """The leading part of a completions `prompt`: a string, token ids, or a batch of either
    (the batch's first prompt, which its pod prefills first)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _leading(prompt, prefix_chars)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        num_tokens = -(-prefix_chars // CHARS_PER_TOKEN)
        if len(prompt) < num_tokens:
            return None
        return "ids:" + ",".join(str(t) for t in prompt[:num_tokens])
    return None


def _chat_prefix(messages: Any, prefix_chars: int) -> str | None:
    """Messages rendered as role/content, only as far as `prefix_chars`."""
    if not isinstance(messages, list):
        return None
    parts: list[str] = []
    size = 0
    for message in messages:
        if size >= prefix_chars:
            break
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if isinstance(content, list):  # content parts: the text ones
            content = "".join(
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        piece = f"{message.get('role', '')}\x1f{content if isinstance(content, str) else ''}\x1e"
        parts.append(piece)
        size += len(piece)
    return _leading("".join(parts), prefix_chars)


def request_features(
    path: str,
    body: bytes,
    *,
    session_id: str | None = None,
    request_id: str = "",
    prefix_chars: int = 256,
) -> RequestFeatures:
    """Features of one request to `path` with raw JSON `body`."""
    prefix: str | None = None
    if body and path in (CHAT_PATH, COMPLETIONS_PATH):
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            payload = None
        if isinstance(payload, dict):
            if path == CHAT_PATH:
                prefix = _chat_prefix(payload.get("messages"), prefix_chars)
            else:
                prefix = _completion_prefix(payload.get("prompt"), prefix_chars)
    key = None if prefix is None else hashlib.blake2b(prefix.encode(), digest_size=16).digest()
    return RequestFeatures(prefix_key=key, session_id=session_id or None, request_id=request_id)
