"""Bounded reads of runtime pods' own endpoints (`/ready`, `/metrics`).

The operator reads bodies from pods, and anything that runs in a watched namespace can answer
on a pod IP: a body is read raw (no decompression: `Accept-Encoding: identity`), at most
`max_bytes` of it, and the whole exchange (connect, headers, every chunk) within `timeout_s`.
httpx's own timeouts bound each network operation, not the sum, so a pod that trickles an
endless body would otherwise hold a read (and grow its buffer) forever.
"""

from __future__ import annotations

import asyncio

import httpx

#: /ready answers a small JSON object.
MAX_READY_BYTES = 64 * 1024
#: /metrics of one runtime: a few KB of Prometheus text; room for many label sets.
MAX_METRICS_BYTES = 2 * 1024 * 1024


class PodReadError(RuntimeError):
    """The pod did not answer within the bounds (unreachable, too slow or too large)."""


async def bounded_get(
    client: httpx.AsyncClient, url: str, *, max_bytes: int, timeout_s: float
) -> tuple[int, bytes]:
    """GET `url` -> (status code, body); PodReadError when it breaks a bound or fails."""
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream(
                "GET", url, timeout=timeout_s, headers={"Accept-Encoding": "identity"}
            ) as resp:
                declared = resp.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes:
                    raise PodReadError(f"GET {url}: body of {declared} bytes over {max_bytes}")
                body = bytearray()
                async for chunk in resp.aiter_raw():
                    body += chunk
                    if len(body) > max_bytes:
                        raise PodReadError(f"GET {url}: body over {max_bytes} bytes")
                return resp.status_code, bytes(body)
    except TimeoutError:
        raise PodReadError(f"GET {url}: TimeoutError: no whole answer in {timeout_s:g}s") from None
    except httpx.HTTPError as exc:
        raise PodReadError(f"GET {url}: {exc.__class__.__name__}") from exc
