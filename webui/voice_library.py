"""The voice library: the example voices and the saved ones (public, and this browser's own) as cards, each
with a play button (its recording, ``/webui/voice/{id}``), one "use" for every mode, and for the browser's
own voices rename and delete with undo.

Using a card: an example in a prompt mode goes through the example chips' own fill (``library.js`` clicks
the hidden ``gr.Examples`` button: prompt, transcript, language and a text to speak); everything else
comes here as an action (``library.js`` writes it into a hidden text box): in "Saved voice" mode the card
is picked in the saved-voice list, in a prompt mode a saved voice's recording and transcript fill the
prompt. Deleting keeps the voice's recording and transcript in the visitor's own ``gr.State`` until the
page closes, so Undo saves it again (under its old name, so its old id where that is free).
"""

from __future__ import annotations

import html
import inspect
import json
import logging
import secrets
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from engine.errors import EngineError
from webui.handlers import Studio, Studios, call_engine, owner_of
from webui.stream_route import VOICE_ID
from webui.texts import LANGUAGES, NATIVE_NAMES, Texts, language_name

log = logging.getLogger(__name__)

MAX_TRASH = 8  # deleted voices a page can still bring back
PLAY_SVG = (
    '<svg viewBox="0 0 16 16" width="14" height="14" aria-hidden="true"><path d="M4 2.5v11l9-5.5z" '
    'fill="currentColor"/></svg>'
)


@dataclass(frozen=True)
class VoiceCard:
    id: str
    name: str
    kind: str  # "example", "public" or "own"
    detail: str  # the example's language, a saved voice's length
    prompt_text: str = ""


@dataclass(frozen=True)
class Deleted:
    """A voice this page deleted, kept so Undo can save it again: its name, recording and transcript."""

    id: str
    name: str
    wav: str
    prompt_text: str


def voice_cards(examples: Sequence[Any], voices: Sequence[Any], t: Texts) -> list[VoiceCard]:
    """The browser's own voices first (what the visitor made), then the examples (as the engine lists
    them), then the public ones, each by name."""
    out = [
        VoiceCard(
            str(e.id),
            str(e.name),
            "example",
            NATIVE_NAMES.get(str(e.language)) or language_name(e.language, t),
        )
        for e in examples
    ]
    seen = {c.id for c in out}
    for v in voices:
        if str(v.id) in seen or getattr(v, "example", False):
            continue
        kind = "public" if getattr(v, "public", False) else "own"
        detail = t("library_seconds", seconds=float(getattr(v, "duration_s", 0.0) or 0.0))
        out.append(VoiceCard(str(v.id), str(v.name), kind, detail, str(getattr(v, "prompt_text", ""))))
    return sorted(out, key=lambda c: ("own", "example", "public").index(c.kind))  # stable: by name within


def _button(op: str, card: VoiceCard, label: str, cls: str = "", inner: str = "") -> str:
    voice, text = html.escape(card.id), html.escape(label)
    return (
        f'<button type="button" class="cosy-vbtn {cls}" data-lib-op="{op}" data-voice="{voice}"'
        f' data-kind="{card.kind}" aria-label="{text}">{inner or text}</button>'
    )


def _card(card: VoiceCard, t: Texts) -> str:
    name = html.escape(card.name)
    play = _button("play", card, t("library_play", name=card.name), "cosy-vplay", PLAY_SVG)
    use = (
        f'<button type="button" class="cosy-vname" data-lib-op="use" data-voice="{html.escape(card.id)}"'
        f' data-kind="{card.kind}" title="{html.escape(t("library_use", name=card.name))}">{name}</button>'
    )
    own = ""
    if card.kind == "own":
        own = _button("rename", card, t("library_rename")) + _button("delete", card, t("library_delete"))
    meta = f"{html.escape(t('library_' + card.kind))} · {html.escape(card.detail)}"
    return (
        f'<div class="cosy-vcard" data-voice="{html.escape(card.id)}" data-kind="{card.kind}">{play}'
        f'<div class="cosy-vtext">{use}<span class="cosy-vmeta">{meta}</span></div>'
        f'<div class="cosy-vacts">{own}</div></div>'
    )


def library_html(cards: Sequence[VoiceCard], t: Texts, note: str = "", undo: Deleted | None = None) -> str:
    """The cards, and a one-line note (with Undo after a delete). ``data-rename`` is the rename prompt's
    question, read by ``library.js`` in the page's language."""
    undo_btn = ""
    if undo is not None:
        undo_btn = (
            f' <button type="button" class="cosy-vbtn cosy-undo" data-lib-op="undo"'
            f' data-voice="{html.escape(undo.id)}">{html.escape(t("library_undo"))}</button>'
        )
    line = f'<div class="cosy-note cosy-lib-note">{html.escape(note)}{undo_btn}</div>' if note else ""
    return (
        f'<div class="cosy-lib" data-rename="{html.escape(t("library_rename_ask"))}">'
        f'<div class="cosy-lib-title">{html.escape(t("library_title"))}</div>'
        f'<div class="cosy-vcards">{"".join(_card(c, t) for c in cards)}</div>{line}</div>'
    )


class VoiceShelf:
    """The library's listeners for one studio (its language, engine and audio store)."""

    def __init__(self, studio: Studio):
        self.studio, self.t = studio, studio.t

    async def cards(self, browser_id: str) -> list[VoiceCard]:
        engine = self.studio.engine
        voices = await call_engine(engine.list_voices, owner_of(browser_id))
        return voice_cards(engine.example_voices(), voices, self.t)

    async def page(self, browser_id: str) -> str:
        return library_html(await self.cards(browser_id), self.t)

    async def saved(self, browser_id: str, voice_id: str | None) -> str:
        """After Save: the library with the new card, and the note at the top of the column (the note
        under the Save button could be below the window)."""
        cards = await self.cards(browser_id)
        card = next((c for c in cards if c.id == voice_id), None)
        return library_html(cards, self.t, self.t("saved_as", name=card.name) if card else "")

    async def act(
        self, action: str, mode: str, browser_id: str, trash: list[Deleted] | None
    ) -> tuple[Any, ...]:
        """(prompt, transcript, language, saved-voice list, library, trash) after one card action."""
        trash = list(trash or [])
        try:
            asked = json.loads(action or "{}")
            op, voice_id = str(asked.get("op", "")), str(asked.get("voice", ""))
        except (ValueError, AttributeError):
            op, voice_id = "", ""
        if not VOICE_ID.match(voice_id) or op not in ("use", "delete", "undo", "rename"):
            return (*[gr.skip()] * 5, trash)
        try:
            return await getattr(self, f"_{op}")(voice_id, mode, browser_id, trash, asked)
        except EngineError as err:
            note = self.studio.engine_message(err)
        except gr.Error as err:
            note = str(err.message)
        page = library_html(await self.cards(browser_id), self.t, note)
        return (*[gr.skip()] * 4, page, trash)

    async def _list(self, browser_id: str, value: Any = None) -> Any:
        choices = await self.studio.voice_choices(browser_id)
        return gr.Dropdown(choices=choices) if value is None else gr.Dropdown(choices=choices, value=value)

    def _copy(self, voice_id: str, browser_id: str) -> Path | None:
        """The voice's recording copied where Gradio may serve it (the studio's audio store)."""
        preview = getattr(self.studio.engine, "voice_preview", None)
        source = preview(voice_id, owner_of(browser_id)) if preview else None
        if source is None:
            return None
        folder = self.studio.store.root / "voices"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{voice_id}-{secrets.token_hex(6)}.wav"
        shutil.copyfile(source, path)
        return path

    async def _use(self, voice_id: str, mode: str, browser_id: str, trash: list[Deleted], _: Any) -> Any:
        card = next((c for c in await self.cards(browser_id) if c.id == voice_id), None)
        if card is None:
            raise gr.Error(self.t("err_voice_missing"))
        page = library_html(await self.cards(browser_id), self.t, self.t("library_picked", name=card.name))
        listed = [value for _, value in await self.studio.voice_choices(browser_id)]
        if mode == "voice" and voice_id in listed:  # (an engine may list no examples as saved voices)
            return gr.skip(), gr.skip(), gr.skip(), await self._list(browser_id, voice_id), page, trash
        wav = self._copy(voice_id, browser_id)
        if wav is None:  # nothing kept to clone from: it can still be used as a saved voice
            note = self.t("library_no_recording", name=card.name)
            return (*[gr.skip()] * 4, library_html(await self.cards(browser_id), self.t, note), trash)
        example = next((e for e in self.studio.engine.example_voices() if str(e.id) == voice_id), None)
        text = str(example.transcript) if example is not None else card.prompt_text
        known = example is not None and example.language in LANGUAGES
        language = str(example.language) if known and example is not None else gr.skip()
        return str(wav), text, language, gr.skip(), page, trash

    async def _delete(self, voice_id: str, mode: str, browser_id: str, trash: list[Deleted], _: Any) -> Any:
        owner = self.studio.browser_owner(browser_id)
        card = next((c for c in await self.cards(browser_id) if c.id == voice_id and c.kind == "own"), None)
        if card is None:
            raise gr.Error(self.t("err_voice_missing"))
        wav = self._copy(voice_id, browser_id)
        await call_engine(self.studio.engine.delete_voice, voice_id, owner)
        gone = Deleted(voice_id, card.name, str(wav) if wav else "", card.prompt_text)
        trash = [*trash, gone][-MAX_TRASH:] if wav else trash
        note = self.t("deleted", name=card.name)
        page = library_html(await self.cards(browser_id), self.t, note, gone if wav else None)
        return gr.skip(), gr.skip(), gr.skip(), await self._list(browser_id), page, trash

    async def _undo(self, voice_id: str, mode: str, browser_id: str, trash: list[Deleted], _: Any) -> Any:
        owner = self.studio.browser_owner(browser_id)
        gone = next((d for d in reversed(trash) if d.id == voice_id), None)
        if gone is None:
            raise gr.Error(self.t("err_voice_missing"))
        voice = await call_engine(self.studio.engine.add_voice, gone.name, gone.wav, gone.prompt_text, owner)
        trash = [d for d in trash if d is not gone]
        note = self.t("library_restored", name=voice.name)
        page = library_html(await self.cards(browser_id), self.t, note)
        return gr.skip(), gr.skip(), gr.skip(), await self._list(browser_id), page, trash

    async def _rename(
        self, voice_id: str, mode: str, browser_id: str, trash: list[Deleted], asked: Any
    ) -> Any:
        """Saved again under the new name from its kept recording, then the old entry deleted: the library
        keeps no name apart from its entry (a voice's id is a slug of its name)."""
        owner = self.studio.browser_owner(browser_id)
        new_name = str(asked.get("name", "")).strip()
        card = next((c for c in await self.cards(browser_id) if c.id == voice_id and c.kind == "own"), None)
        if card is None:
            raise gr.Error(self.t("err_voice_missing"))
        if not new_name or new_name == card.name:
            raise gr.Error(self.t("err_no_voice_name"))
        wav = self._copy(voice_id, browser_id)
        if wav is None:
            raise gr.Error(self.t("library_no_recording", name=card.name))
        voice = await call_engine(self.studio.engine.add_voice, new_name, str(wav), card.prompt_text, owner)
        await call_engine(self.studio.engine.delete_voice, voice_id, owner)
        note = self.t("library_renamed", old=card.name, name=voice.name)
        page = library_html(await self.cards(browser_id), self.t, note)
        return gr.skip(), gr.skip(), gr.skip(), await self._list(browser_id, str(voice.id)), page, trash


def routed(studios: Studios, name: str, owner_at: int) -> Callable[..., Any]:
    """``VoiceShelf.<name>`` as a Gradio event function in the request's language; with a login the
    session's namespace replaces the browser id at ``owner_at`` (as ``Studios.listener`` does)."""
    assert inspect.iscoroutinefunction(getattr(VoiceShelf, name))

    async def coro(request: gr.Request, *args: Any) -> Any:
        shelf = VoiceShelf(studios.pick(request))
        return await getattr(shelf, name)(*studios.signed(request, owner_at, args))

    coro.__name__ = coro.__qualname__ = f"library_{name}"  # Gradio names the event's API endpoint after it
    return coro
