"""Incremental detokenization with stop strings, for streaming.

A push decodes the tokens not yet final together with the CONTEXT tokens before them, and keeps what
follows the context's own text (as vLLM does): a token can complete a character another one began,
and a decoder may treat a text's first token differently (a stripped leading space), so tokens are
read in context. Decoding every token so far at each push would cost O(length) a push instead, as
much host time as a short segment's device time for a few requests (bench/NOTES.md, "Serving: where
a 16-slot segment's time went"). Text is handed out as it becomes
final: text ending in an incomplete UTF-8 sequence (U+FFFD), and the last len(longest stop string)
- 1 characters, which might begin a stop string, wait for the next tokens. A stop string ends the
text before its first occurrence.
"""

from __future__ import annotations

from jaxspec.tokenizer import Tokenizer

CONTEXT = 5  # tokens decoded before the new ones


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.final = ""  # the text of ids[:done], which ended in a whole character
        self.done = 0
        self.text = ""  # the text of every id so far (the final text and the rest's, read in context)
        self.sent = 0  # characters handed out
        self.stopped = False

    def push(self, ids: list[int]) -> tuple[str, bool]:
        """(new final text, whether a stop string ended the text). After a stop, pushes add nothing."""
        if self.stopped:
            return "", True
        self.ids += ids
        self.text = self._decode()
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

    def _decode(self) -> str:
        """The text of every id so far; it becomes the final text when it ends in a whole character."""
        start = max(0, self.done - CONTEXT)
        before = self.tokenizer.decode(self.ids[start : self.done], skip_special_tokens=True)
        now = self.tokenizer.decode(self.ids[start:], skip_special_tokens=True)
        if now.startswith(before):
            text = self.final + now[len(before) :]
        else:  # a decoder whose text of a window is not a prefix of a longer one's: all the ids
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.final, self.done = text, len(self.ids)
        return text

    def _send(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out
