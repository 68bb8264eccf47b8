"""The studio's live-text feed: the box's words at a rate, then typed words, then the end when idle."""

from __future__ import annotations

import asyncio

from webui.live_text import LiveTexts

RID = "a" * 32


async def test_words_go_out_then_typed_text_then_the_feed_ends_when_idle() -> None:
    feeds = LiveTexts(idle_s=0.3)
    feed = feeds.open(RID, "Hello there", wps=1000)
    it = feed.pieces()
    assert [await anext(it), await anext(it)] == ["Hello", " there"]
    pending = asyncio.ensure_future(anext(it))  # waits: nothing new yet
    await asyncio.sleep(0.05)
    assert not pending.done()
    feeds.update(RID, "Hello there my fr")
    assert [await pending, await anext(it)] == [" my", " fr"]  # an unfinished word goes out as typed
    feeds.update(RID, "Hello there my friend")
    assert await anext(it) == "iend"
    assert [p async for p in it] == []  # idle: the text is complete
    assert feed.sent == "Hello there my friend"


async def test_text_edited_before_the_spoken_part_is_not_sent() -> None:
    feeds = LiveTexts(idle_s=0.2)
    feed = feeds.open(RID, "One two", wps=1000)
    got = [await anext(feed.pieces())]
    feeds.update(RID, "Uno two three")  # rewrote what was already spoken
    got += [p async for p in feed.pieces()]
    assert got == ["One"]
    feeds.close(RID)
    feeds.update(RID, "ignored")  # a finished request's feed is gone
