"""Reading an OpenAI event stream in tests: how it ended, for the mid-stream failure tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx


@dataclass(slots=True)
class StreamEnd:
    chunks: int = 0
    done: bool = False
    """`data: [DONE]` came."""
    errored: bool = False
    """An error event came, or the connection broke."""
    finished: bool = False
    """A choice ended with finish_reason "length" (every token asked for)."""

    @property
    def complete(self) -> bool:
        return self.done and self.finished and not self.errored


async def read_sse(r: httpx.Response, on_first: Callable[[], None] = lambda: None) -> StreamEnd:
    """Read `r`'s events to the end; `on_first` runs when the first event arrives."""
    end = StreamEnd()
    try:
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                end.done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                end.errored |= "error" in event
                if event.get("choices"):
                    end.finished |= event["choices"][0].get("finish_reason") == "length"
                end.chunks += 1
                if end.chunks == 1:
                    on_first()
    except httpx.HTTPError:
        end.errored = True
    return end
