"""OutputText: a request's output text, detokenized token by token, with its stop strings.

A stop string is never emitted: the text is cut where the first one starts. While a stream
could still be inside one, that many characters are held back from the emitted delta.
"""

from __future__ import annotations

from kubeinfer.runtime.tokenizer import IncrementalDetokenizer


class OutputText:
    def __init__(self, detokenizer: IncrementalDetokenizer | None, stops: list[str]) -> None:
        self.detokenizer = detokenizer
        self.stops = stops
        self.text = ""
        self.num_emitted = 0

    def push(self, token: int, finished: bool) -> tuple[str, str | None]:
        """Add one token (flush if it is the last); (text to emit now, stop string hit)."""
        if self.detokenizer is None:
            return "", None
        start = len(self.text)
        self.text += self.detokenizer.push([token])
        if finished:
            self.text += self.detokenizer.flush()
        hit = None
        stops = self.stops
        if stops:
            longest = max(map(len, stops))
            window_start = max(start - longest + 1, 0)
            hits = [(i, s) for s in stops if (i := self.text.find(s, window_start)) >= 0]
            if hits:
                index, hit = min(hits)
                self.text = self.text[:index]
                finished = True
        # while a stream could be in the middle of a stop string, hold its start back
        holdback = 0 if finished or not stops else max(map(len, stops)) - 1
        limit = max(len(self.text) - holdback, self.num_emitted)
        new_text = self.text[self.num_emitted : limit]
        self.num_emitted = limit
        return new_text, hit
