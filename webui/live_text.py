"""The studio's "live text" mode: the text box feeds the engine while it is being written.

On Generate with live text on, the box's content is sent word by word at the chosen words per second (a
pasted text played like an LLM writing it); what is typed into the box afterwards is sent as it is typed
(the box's ``input`` event). The text ends once everything was sent and the box has not changed for
``idle_s``. ``LiveTexts`` maps the request id the browser drew (the same id the live player reads) to its
feed, exactly like ``StreamHub`` does for the audio, and forgets a feed when its request ends.
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from collections.abc import AsyncIterator

_WORD = re.compile(r"\s*\S+")  # a word with the whitespace before it


class LiveText:
    """One request's text source: the box's snapshots in, new pieces out."""

    def __init__(self, text: str, wps: float, idle_s: float):
        self.wps, self.idle_s = wps, idle_s
        self.sent = ""
        self._latest = text
        self._changed = asyncio.Event()

    def update(self, text: str) -> None:
        """A new snapshot of the box (typing). Only text appended to what was sent can still be spoken."""
        self._latest = text
        self._changed.set()

    def _next_word(self) -> str | None:
        if not self._latest.startswith(self.sent):  # edited before the spoken part: nothing more to send
            return None
        # a word still being typed goes out as it is: the engine holds back an unfinished tail
        match = _WORD.match(self._latest, len(self.sent))
        return None if match is None else match.group()

    async def pieces(self) -> AsyncIterator[str]:
        """The words at ``wps`` while there is text, then typed words as they come, until idle."""
        while True:
            while (word := self._next_word()) is not None:
                self.sent += word
                yield word
                await asyncio.sleep(1.0 / self.wps)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), self.idle_s)
            except TimeoutError:
                return


class LiveTexts:
    """Live-text feeds by request id (a bounded registry: the oldest go first)."""

    IDLE_S = 3.0  # the text ends this long after the box's last change

    def __init__(self, max_feeds: int = 256, idle_s: float | None = None):
        self.max_feeds, self.idle_s = max_feeds, self.IDLE_S if idle_s is None else idle_s
        self._feeds: OrderedDict[str, LiveText] = OrderedDict()

    def open(self, rid: str, text: str, wps: float) -> LiveText:
        feed = self._feeds[rid] = LiveText(text, wps, self.idle_s)
        while len(self._feeds) > self.max_feeds:
            self._feeds.popitem(last=False)
        return feed

    def update(self, rid: str, text: str) -> None:
        feed = self._feeds.get(rid)
        if feed is not None:
            feed.update(text)

    def close(self, rid: str) -> None:
        self._feeds.pop(rid, None)
