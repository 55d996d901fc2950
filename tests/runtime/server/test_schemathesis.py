"""Property-based requests from the server's own OpenAPI schema: no input gives a 5xx.

Three runs, each bounded (a fixed seed, derandomized hypothesis, a timeout per request) on the
tiny model (max_model_len 128, vocabulary 49152):
- positive: up to 100 schema-valid cases per operation (>= 300 in all, counted);
- negative: up to 50 cases per operation that violate the schema (wrong types, out of range,
  missing fields): each must be a 4xx with an OpenAI error body;
- hostile: schema-valid bodies from the edges the schema cannot describe (token ids around and
  far past the vocabulary, lists past the server's caps, min_tokens with stop ids, long stop
  strings): each a 200 or a 4xx, and after every case the engine still serves.
schemathesis drives generation from the schema; hypothesis runs it (schemathesis' own pytest
plugin does not work with pytest 9).
"""

from __future__ import annotations

from collections import Counter

import httpx
import schemathesis
import schemathesis.specs.openapi.schemas  # noqa: F401 - see below
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

from .conftest import Server

# schemathesis imports its OpenAPI modules on the first `from_url`, and pytest rewrites their
# asserts with `ast` as they load. On CPython 3.11.7 `ast` keeps its recursion depth per process,
# not per thread (gh-106905), so a parse racing another thread's failed in CI with "AST
# constructor recursion depth mismatch". Imported here, they are rewritten at collection, while
# the test process has one thread.


def _schema(server: Server):  # noqa: ANN202
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    schema.config.update(base_url=server.url)
    return schema


def test_no_server_errors(tiny_server: Server) -> None:
    schema = _schema(tiny_server)
    counts: Counter[str] = Counter()
    failures: list[str] = []
    for result in schema.get_all_operations():
        _property_test(result.ok(), tiny_server, counts, failures)()
    assert not failures, failures[:5]
    assert sum(counts.values()) >= 300, counts
    print(dict(counts))


def test_no_server_errors_outside_the_schema(tiny_server: Server) -> None:
    schema = _schema(tiny_server)
    counts: Counter[str] = Counter()
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.method.upper() != "POST":
            continue  # GETs take no body: nothing to break
        _property_test(operation, tiny_server, counts, failures, GenerationMode.NEGATIVE, 50)()
    assert not failures, failures[:5]
    assert sum(counts.values()) >= 60, counts
    _assert_still_serving(tiny_server)
    print(dict(counts))


def _property_test(
    operation,  # noqa: ANN001
    server: Server,
    counts: Counter[str],
    failures: list[str],
    mode: GenerationMode = GenerationMode.POSITIVE,
    max_examples: int = 100,
):
    """One hypothesis test per operation; a factory, since @given refuses default arguments
    (newer hypothesis releases), which is how a loop would otherwise bind the operation's label."""
    label = operation.label

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: schemathesis.Case) -> None:
        counts[label] += 1
        response = case.call(headers=server.headers, timeout=60)
        if response.status_code >= 500:
            failures.append(f"{case.method} {case.path} {case.body!r}: {response.text}")
        elif response.status_code >= 400:
            assert "error" in response.json(), response.text

    return check


VOCAB = 49152
token_id = st.one_of(
    st.integers(0, 400),
    st.integers(VOCAB - 3, VOCAB + 3),
    st.integers(VOCAB, 2**63 - 1),
)
hostile_sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(1, 8),
        "min_tokens": st.integers(0, 8),
        "stop_token_ids": st.lists(token_id, max_size=140),
        "stop": st.one_of(st.text(max_size=300), st.lists(st.text(max_size=40), max_size=20)),
        "temperature": st.sampled_from([0.0, 0.7, 2.0]),
        "top_k": st.integers(-1, 2 * VOCAB),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "ignore_eos": st.booleans(),
        "cache_salt": st.text(min_size=1, max_size=260),
        # issue #18's fields: ids past the vocabulary, past the entry cap, values past the range
        "logit_bias": st.dictionaries(
            token_id.map(str), st.floats(-150, 150), max_size=310
        ),
        "n": st.integers(1, 8),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.01, 2),
    },
)
completion_extras = st.fixed_dictionaries(
    {},
    optional={"echo": st.booleans(), "logprobs": st.integers(0, 5), "best_of": st.integers(1, 8)},
)
chat_extras = st.fixed_dictionaries(
    {}, optional={"logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)}
)
hostile_prompt = st.one_of(
    st.text(min_size=1, max_size=200),
    st.lists(token_id, min_size=1, max_size=40),
    st.lists(st.lists(token_id, min_size=1, max_size=8), min_size=1, max_size=140),
)


def test_hostile_values_within_the_schema(tiny_server: Server) -> None:
    counts: Counter[int] = Counter()

    @given(sampling=hostile_sampling, prompt=hostile_prompt, chat=st.booleans(),
           completion=completion_extras, chat_only=chat_extras)
    @settings(max_examples=120, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(
        sampling: dict, prompt: object, chat: bool, completion: dict, chat_only: dict
    ) -> None:
        if chat:
            text = prompt if isinstance(prompt, str) else "hi"
            path = "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": text}], **chat_only}
        else:
            path, body = "/v1/completions", {"prompt": prompt, **completion}
        with tiny_server.client() as client:
            r = client.post(path, json={**body, **sampling})
        counts[r.status_code] += 1
        assert r.status_code in (200, 400, 413), r.text  # 413: the tiny server takes 4 KiB
        if r.status_code != 200:
            assert r.json()["error"]["message"], r.text
        assert httpx.get(f"{tiny_server.url}/health", timeout=10).status_code == 200

    check()
    _assert_still_serving(tiny_server)
    assert counts[400] and counts[200], counts
    print(dict(counts))


def _assert_still_serving(server: Server) -> None:
    with server.client() as client:
        r = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200, r.text
