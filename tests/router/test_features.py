"""request_features: the prefix key of completions, token ids and chats; sessions."""

from __future__ import annotations

import json

from kubeinfer.router.features import CHAT_PATH, COMPLETIONS_PATH, request_features

SYSTEM = "You are a careful assistant. " * 20  # 580 characters


def completion(prompt: object) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}).encode()


def chat(*turns: tuple[str, str]) -> bytes:
    messages = [{"role": role, "content": content} for role, content in turns]
    return json.dumps({"model": "m", "messages": messages}).encode()


def key(path: str, body: bytes) -> bytes | None:
    return request_features(path, body, prefix_chars=256).prefix_key


def test_prompts_sharing_their_leading_characters_share_a_key() -> None:
    a = key(COMPLETIONS_PATH, completion(SYSTEM + "question one"))
    b = key(COMPLETIONS_PATH, completion(SYSTEM + "another question"))
    c = key(COMPLETIONS_PATH, completion("Different start. " + SYSTEM))
    assert a is not None and a == b and a != c


def test_short_or_unreadable_prompts_have_no_key() -> None:
    assert key(COMPLETIONS_PATH, completion("hello")) is None
    assert key(COMPLETIONS_PATH, b"{not json") is None
    assert key(COMPLETIONS_PATH, b"[1, 2]") is None
    assert key(COMPLETIONS_PATH, completion({"x": 1})) is None
    assert key("/v1/models", b"") is None


def test_token_ids_and_batches() -> None:
    ids = list(range(100))
    assert key(COMPLETIONS_PATH, completion(ids)) == key(COMPLETIONS_PATH, completion(ids + [7]))
    assert key(COMPLETIONS_PATH, completion(ids[:10])) is None
    batch = key(COMPLETIONS_PATH, completion([SYSTEM + "a", "b"]))
    assert batch == key(COMPLETIONS_PATH, completion(SYSTEM + "z"))
    assert key(COMPLETIONS_PATH, completion([ids, ids])) == key(COMPLETIONS_PATH, completion(ids))


def test_every_turn_of_a_chat_shares_the_key_of_its_system_prompt() -> None:
    first = key(CHAT_PATH, chat(("system", SYSTEM), ("user", "hi")))
    later = key(
        CHAT_PATH,
        chat(("system", SYSTEM), ("user", "hi"), ("assistant", "hello"), ("user", "more")),
    )
    other = key(CHAT_PATH, chat(("system", "Be terse. " + SYSTEM), ("user", "hi")))
    assert first is not None and first == later and first != other
    parts = json.dumps(
        {"messages": [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}]}
    ).encode()
    assert key(CHAT_PATH, parts) == key(CHAT_PATH, chat(("system", SYSTEM)))


def test_the_session_header_and_request_id_are_carried() -> None:
    f = request_features(CHAT_PATH, b"", session_id="s-1", request_id="r")
    assert f.session_id == "s-1" and f.request_id == "r" and f.prefix_key is None
    assert request_features(CHAT_PATH, b"", session_id="").session_id is None
