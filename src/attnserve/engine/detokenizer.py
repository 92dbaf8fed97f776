"""Incremental detokenization and stop-string matching, for one request.

Decoding a whole output every step costs O(n) per token; instead the decoder
keeps two offsets and decodes only a short window (the tokens since the last
emitted boundary), which also keeps multi-byte characters split across tokens
from being emitted half-done (the window's text ends in U+FFFD until complete).
Text that could still grow into a stop string is held back from the stream.

It runs on the consumer's side (the thread or coroutine reading a request's
stream), not on the engine's step thread: the engine deals in token ids only.
"""

from __future__ import annotations

from collections.abc import Sequence

from attnserve.models.tokenizer import decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # decoded so far (cut at the stop string once one matched)
        self.matched_stop: str | None = None
        self.num_tokens_at_stop: int | None = None  # tokens that produced the text up to the stop string
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text is in self.text
        self._streamed = 0  # characters of self.text handed out by take_streamable

    def push(self, new_ids: Sequence[int]) -> str | None:
        """Decode `new_ids` after the previous ones; returns the stop string if one now matches."""
        self.ids.extend(new_ids)
        if self.tokenizer is None or self.matched_stop is not None:
            return self.matched_stop
        # decode token by token so a stop string is attributed to the token that completed it
        for n in range(len(self.ids) - len(new_ids) + 1, len(self.ids) + 1):
            if self._advance(n):
                return self.matched_stop
        return None

    def _advance(self, n: int) -> bool:
        window = self.ids[self._prefix : n]
        before = decode(self.tokenizer, self.ids[self._prefix : self._read], self.skip_special_tokens)
        now = decode(self.tokenizer, window, self.skip_special_tokens)
        if now.endswith("\ufffd"):
            return False  # a character is split across tokens; wait for the rest
        delta = now[len(before) :]
        if not delta:
            return False
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += delta
        self._prefix, self._read = self._read, n
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, start)) != -1]
        if not hits:
            return False
        at, stop = min(hits)  # the earliest match in the text wins, whatever the list order
        self.text = self.text[:at]
        self.matched_stop = stop
        self.num_tokens_at_stop = n
        return True

    def take_streamable(self, finished: bool) -> str:
        """New text safe to stream: all of it once finished, else all but a tail that may begin a stop string."""
        text = self.text
        hold = 0
        if not finished and self.matched_stop is None:
            for stop in self.stop:
                for k in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:k]):
                        hold = max(hold, k)
                        break
        end = len(text) - hold
        out = text[self._streamed : end] if end > self._streamed else ""
        self._streamed = max(self._streamed, end)
        return out
