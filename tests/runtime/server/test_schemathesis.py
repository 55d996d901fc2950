"""Property-based requests from the server's own OpenAPI schema: no input gives a 5xx.

Bounded: a fixed seed (derandomized hypothesis), at most 100 generated cases per operation
(>= 300 in all, counted), each request with a timeout, on the tiny model (max_model_len 128).
schemathesis drives generation from the schema; hypothesis runs it (schemathesis' own pytest
plugin does not work with pytest 9).
"""

from __future__ import annotations

from collections import Counter

import schemathesis
from hypothesis import HealthCheck, given, settings

from .conftest import Server


def test_no_server_errors(tiny_server: Server) -> None:
    schema = schemathesis.openapi.from_url(f"{tiny_server.url}/openapi.json")
    schema.config.update(base_url=tiny_server.url)
    counts: Counter[str] = Counter()
    failures: list[str] = []
    for result in schema.get_all_operations():
        _property_test(result.ok(), tiny_server, counts, failures)()
    assert not failures, failures[:5]
    assert sum(counts.values()) >= 300, counts
    print(dict(counts))


def _property_test(operation, server: Server, counts: Counter[str], failures: list[str]):
    """One hypothesis test per operation; a factory, since @given refuses default arguments
    (newer hypothesis releases), which is how a loop would otherwise bind the operation's label."""
    label = operation.label

    @given(case=operation.as_strategy())
    @settings(max_examples=100, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: schemathesis.Case) -> None:
        counts[label] += 1
        response = case.call(headers=server.headers, timeout=60)
        if response.status_code >= 500:
            failures.append(f"{case.method} {case.path} {case.body!r}: {response.text}")
        elif response.status_code >= 400:
            assert "error" in response.json(), response.text

    return check
