"""Incremental detokenization with stop strings, for streaming.

Text is decoded from all of a request's tokens so far (a token can complete a character another one
began) and handed out as it becomes final: text ending in an incomplete UTF-8 sequence (U+FFFD), and
the last len(longest stop string) - 1 characters, which might begin a stop string, wait for the next
tokens. A stop string ends the text before its first occurrence.
"""

from __future__ import annotations

from jaxspec.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded so far
        self.sent = 0  # characters handed out
        self.stopped = False

    def push(self, ids: list[int]) -> tuple[str, bool]:
        """(new final text, whether a stop string ended the text). After a stop, pushes add nothing."""
        if self.stopped:
            return "", True
        self.ids += ids
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (self.text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.text = True, self.text[:cut]
            return self._send(cut), True
        end = len(self.text) - self.hold
        while end > self.sent and self.text[end - 1] == "\ufffd":
            end -= 1
        return self._send(end), False

    def flush(self) -> str:
        """The text held back (the request ended)."""
        return self._send(len(self.text))

    def _send(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out
