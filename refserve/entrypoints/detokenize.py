"""Streaming deltas from cumulative text, never sending what the final text will not hold.

The engine reports each choice's whole text so far (decoded output, cut at a stop string
once one appears). A stream sends only the new part, `text[len(sent):]`, and must never
send characters the final output drops. Two things can still change the tail:

  * a stop string. The engine finishes a sequence in the step its text first contains a
    stop string s, and cuts the text where s begins. So while a sequence runs, no whole
    stop string is in its text, and a stop string that completes later must begin in the
    last len(s) - 1 characters. Holding back max(len(s)) - 1 characters makes every sent
    character final.
  * a multi-byte character split across tokens decodes as U+FFFD until its last byte
    arrives; trailing replacement characters are held back too.

Invariant: the concatenation of all deltas is a prefix of every later text, and equals
the final text once the choice finished.
"""

from __future__ import annotations


class DeltaTracker:
    def __init__(self, stop: list[str] | None = None) -> None:
        self.hold = max((len(s) for s in stop or []), default=1) - 1
        self.sent = ""

    def delta(self, text: str, finished: bool) -> str:
        """The part of `text` that is safe to send now and was not sent before."""
        if finished:
            visible = text
        else:
            visible = text[:len(text) - self.hold] if self.hold else text
            visible = visible.rstrip("\ufffd")
        if len(visible) <= len(self.sent) or not visible.startswith(self.sent):
            return ""
        new, self.sent = visible[len(self.sent):], visible
        return new
