"""Incremental detokenization and stop-string handling.

Decoding a whole output every step costs O(n) per token; instead each request
keeps two offsets and decodes only a short window (the tokens since the last
emitted boundary), which also keeps multi-byte characters split across tokens
from being emitted half-done (the window's text ends in U+FFFD until complete).
Text that could still grow into a stop string is held back from the stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnserve.engine.request import Request


def encode(tokenizer, text: str) -> list[int]:
    out = tokenizer.encode(text)
    return list(getattr(out, "ids", out))


def decode(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@dataclass
class _Offsets:
    prefix: int = 0  # window start
    read: int = 0  # tokens whose text has been emitted


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._offsets: dict[int, _Offsets] = {}

    def forget(self, rid: int) -> None:
        self._offsets.pop(rid, None)

    def update(self, req: Request, num_tokens: int | None = None) -> str | None:
        """Append the text of `req.output_ids[:num_tokens]` to `req.text`; returns the stop string hit, if any."""
        if self.tokenizer is None:
            return None
        ids = req.output_ids if num_tokens is None else req.output_ids[:num_tokens]
        off = self._offsets.setdefault(req.rid, _Offsets())
        skip = req.params.skip_special_tokens
        before = decode(self.tokenizer, ids[off.prefix : off.read], skip)
        now = decode(self.tokenizer, ids[off.prefix :], skip)
        if now.endswith("\ufffd"):
            return None  # a character is split across tokens; wait for the rest
        delta = now[len(before) :]
        if not delta:
            return None
        start = max(0, len(req.text) - max((len(s) for s in req.params.stop), default=0))
        req.text += delta
        off.prefix, off.read = off.read, len(ids)
        for stop in req.params.stop:
            at = req.text.find(stop, start)
            if at != -1:
                req.text = req.text[:at]
                return stop
        return None

    @staticmethod
    def streamable(req: Request) -> str:
        """New text safe to stream: everything except a tail that might begin a stop string."""
        text = req.text
        hold = 0
        if not req.finished:
            for stop in req.params.stop:
                for k in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:k]):
                        hold = max(hold, k)
                        break
        end = len(text) - hold
        out = text[req.streamed_chars : end] if end > req.streamed_chars else ""
        req.streamed_chars = max(req.streamed_chars, end)
        return out
