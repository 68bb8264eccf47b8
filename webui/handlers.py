"""Thin UI handlers: UI values -> ``SynthesisRequest`` -> ``engine.stream`` -> UI updates.

``Studio`` holds what the listeners share (engine, limits, labels, the live-PCM hub, the audio store); its
methods are the listener functions ``layout.py`` wires up. Input checks that need only the UI's values
happen here so a bad input fails before it queues for the GPU (a translated ``gr.Error``); everything else
is the engine's to judge. A request the engine refuses or fails ends with a translated "failed" status, a
toast and a Retry button, never with the engine's own exception text (that goes to the log). This is the
only module that raises ``gr.Error``.

Languages: ``Studios`` holds one ``Studio`` per UI language (sharing the server panel's samples and the
stopped-request ids) and hands each event to the one its request's Accept-Language picks (or the forced
``--ui-lang``). Voice ownership: the browser sends its random id (kept in localStorage, ``OWNER_JS``) with
every voice event; the studio saves, lists and deletes in that id's namespace only.
"""

from __future__ import annotations

import asyncio
import copy
import html
import inspect
import logging
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol

import gradio as gr
import numpy as np
import soundfile as sf

from engine.config import Limits
from engine.errors import (
    Busy,
    EngineError,
    Forbidden,
    InvalidInput,
    NotFound,
    NotReady,
    Stopping,
    Unspeakable,
)
from engine.lexicons import Hit, Lexicon, LexiconLibrary, StreamApplier
from engine.request import AudioChunk, Mode, SynthesisRequest, new_request_id
from engine.serving.metrics import RequestMetrics, ServerStats
from webui import views
from webui.live_text import LiveTexts
from webui.stream_route import RID, AudioStore, StreamHub, browser_owner
from webui.stream_route import STUDIO_OWNER as STUDIO_OWNER  # where the voice namespaces were named first
from webui.texts import EXAMPLES, LANGUAGES, UI_LANGS, Texts, browser_lang, language_name

log = logging.getLogger(__name__)

UI_MODES = ("zero_shot", "cross_lingual", "instruct", "vc", "voice")  # "voice" = zero-shot with a saved voice
PROMPT_MIN_S = 3.0  # shorter prompts clone poorly; the engine's own floor (Limits.min_prompt_s) is lower
MAX_HISTORY = 50
# The browser's id, read from localStorage or drawn on the first visit in the browser (never a server-side
# guess) by ``static/browser_id.js``, the one script that draws it for the studio and the prompt lab alike.
OWNER_JS = "(current) => (window.cosyBrowserId ? window.cosyBrowserId() : '')"
SAMPLE_TEXTS = dict(EXAMPLES)  # language -> a text to speak, for the example voices


class Engine(Protocol):
    """The part of ``engine.serving.engine.TTSEngine`` the studio uses."""

    sample_rate: int
    model_name: str

    def stream(self, req: SynthesisRequest) -> AsyncGenerator[AudioChunk, None]: ...
    def abort(self, request_id: str) -> bool: ...
    def stats(self) -> ServerStats: ...
    def instruct_presets(self) -> Sequence[Any]: ...
    def add_voice(self, name: str, prompt_wav: str, prompt_text: str, owner: str | None = None) -> Any: ...
    def list_voices(self, owner: str | None = None) -> Any: ...  # a Sequence, or a coroutine (call_engine)
    def delete_voice(self, voice_id: str, owner: str | None = None) -> Any: ...
    def example_voices(self) -> Sequence[Any]: ...


@dataclass(frozen=True)
class Form:
    """Generate's inputs as the page sends them, in this order (``layout`` lists its components by these
    names; the browser hook finds ``stream`` and ``rid`` by position)."""

    mode: str = "zero_shot"
    prompt_wav: str | None = None
    prompt_text: str = ""
    instruct_text: str = ""
    source_wav: str | None = None
    voice_id: str | None = None
    language: str = "auto"
    text: str = ""
    stream: bool = True
    speed: float = 1.0
    seed: float | None = -1
    rid: str = ""  # drawn by the browser at click time (``player.generate_js``)
    history: tuple[views.HistoryEntry, ...] = ()
    browser_id: str = ""  # the browser's voice namespace (``OWNER_JS``)
    live: bool = False  # the text arrives as it is typed (``live_text.py``)
    wps: float = 4.0  # live text: words per second
    lexicon: str = ""  # a saved lexicon's id applied to the text before synthesis (``engine.lexicons``)

    @classmethod
    def from_ui(cls, *values: Any) -> Form:
        """The listener's positional values; Gradio's None for an empty field becomes the field's default."""
        names = [f.name for f in fields(cls)]
        given = {k: v for k, v in zip(names, values, strict=True) if v is not None}
        text_fields = ("prompt_text", "instruct_text", "text", "language", "rid", "browser_id", "lexicon")
        # a str subclass stays itself: a signed-in session's ``Account`` must reach ``owner_of`` as one
        given |= {
            k: given[k] if isinstance(given[k], str) else str(given[k]) for k in text_fields if k in given
        }
        given["history"] = tuple(given.get("history", ()))
        return cls(**given)


FORM_FIELDS = tuple(f.name for f in fields(Form))


def user_error(message: str) -> gr.Error:
    return gr.Error(message, print_exception=False)


async def _noted(work: Awaitable[tuple[Any, str]]) -> tuple[Any, str]:
    """A voice listener's (dropdown, note), its refusal (a ``gr.Error``) turned into a red note with the
    dropdown left as it is."""
    try:
        return await work
    except gr.Error as err:
        return gr.skip(), views.note_html(str(err.message), "bad")


def _same_bytes(a: Path, b: Path) -> bool:
    try:
        return a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()
    except OSError:  # a file gone from the cache: not that example
        return False


def audio_seconds(path: str) -> tuple[float, int]:
    """(duration s, sample rate Hz) of an audio file; PyAV for what libsndfile cannot read (webm, m4a)."""
    try:
        info = sf.info(path)
        return info.frames / info.samplerate, info.samplerate
    except sf.LibsndfileError:
        import av

        with av.open(path) as container:
            stream = container.streams.audio[0]
            return float(container.duration or 0) / 1e6, int(stream.rate or 0)


async def call_engine(fn: Any, *args: Any) -> Any:
    """Await the engine's coroutine methods; run blocking ones (voice feature extraction) off the loop."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    return await asyncio.to_thread(fn, *args)


class Account(str):
    """A signed-in session's voice namespace (its key's, as the API has it), put by ``Studios`` in place of
    the browser id the page sent; the page can only ever send a plain ``str``, never one of these."""


def owner_of(browser_id: str | None) -> str | None:
    """The voice namespace of a browser id; None (public voices only) for anything not drawn by OWNER_JS."""
    if isinstance(browser_id, Account):
        return str(browser_id) or None
    return browser_owner(browser_id)


class Studio:
    def __init__(
        self, engine: Engine, limits: Limits, t: Texts, hub: StreamHub, store: AudioStore,
        random_weights: bool = False,
    ):  # fmt: skip
        self.engine, self.limits, self.t, self.hub, self.store = engine, limits, t, hub, store
        self.random_weights = random_weights
        self.chips: dict[str, str] = {}  # the header's model facts (name, family, rate)
        self.prompt_min_s = max(PROMPT_MIN_S, limits.min_prompt_s)
        self.mode_labels = {m: t(f"mode_{m}") for m in UI_MODES}
        self._samples: deque[tuple[float, float]] = deque(maxlen=90)  # (monotonic s, audio s total)
        self._stopped: OrderedDict[str, None] = OrderedDict()  # request ids Stop was pressed for
        self.live = LiveTexts()  # live-text feeds of running requests

    def in_language(self, t: Texts) -> Studio:
        """The same studio speaking ``t``'s language (shares the engine, hub, store and per-server state)."""
        other = copy.copy(self)
        other.t, other.mode_labels = t, {m: t(f"mode_{m}") for m in UI_MODES}
        return other

    # ---- input checks -------------------------------------------------------------------------------
    def check_prompt(self, path: str | None) -> None:
        if not path:
            raise user_error(self.t("err_no_prompt"))
        try:
            seconds, _ = audio_seconds(path)
        except Exception as err:  # any decoder failure is the user's file, not our bug
            log.info("prompt audio unreadable: %r", err)  # the decoder's words stay in the log
            raise user_error(self.t("prompt_unreadable")) from err
        if seconds < self.prompt_min_s:
            raise user_error(self.t("prompt_short", seconds=seconds, min_s=self.prompt_min_s))
        if seconds > self.limits.max_prompt_s:
            raise user_error(self.t("prompt_long", seconds=seconds, max_s=self.limits.max_prompt_s))

    def check_text(self, text: str) -> None:
        if not text:
            raise user_error(self.t("err_no_text"))
        if len(text) > self.limits.max_text_chars:
            raise user_error(self.t("err_text_long", chars=len(text), limit=self.limits.max_text_chars))

    def build_request(self, form: Form) -> SynthesisRequest:
        """Validate the form for its mode and build the engine request (``gr.Error`` on a bad input)."""
        mode, text, prompt_text = form.mode, form.text.strip(), form.prompt_text.strip()
        instruct_text = form.instruct_text.strip()
        if mode not in UI_MODES:
            raise user_error(self.t("err_bad_setting", error=f"mode {mode!r}"))
        if mode != "vc" and not form.live:
            self.check_text(text)
        if mode == "voice" and not form.voice_id:
            raise user_error(self.t("err_no_voice"))
        if mode != "voice":
            self.check_prompt(form.prompt_wav)
        if mode == "zero_shot" and not prompt_text:
            raise user_error(self.t("err_no_prompt_text"))
        if mode == "instruct" and not instruct_text:
            raise user_error(self.t("err_no_instruct"))
        if mode == "vc" and not form.source_wav:
            raise user_error(self.t("err_no_source"))
        try:
            return SynthesisRequest(
                text="" if mode == "vc" else text,
                mode=Mode.ZERO_SHOT if mode == "voice" else Mode(mode),
                prompt_wav=None if mode == "voice" else form.prompt_wav,
                voice_id=form.voice_id if mode == "voice" else None,
                voice_owner=owner_of(form.browser_id),
                prompt_text=prompt_text if mode == "zero_shot" else "",
                instruct_text=instruct_text if mode == "instruct" else "",
                source_wav=form.source_wav if mode == "vc" else None,
                language=form.language or "auto",
                stream=bool(form.stream),
                speed=float(form.speed),
                seed=None if form.seed is None or form.seed < 0 else int(form.seed),
                request_id=form.rid,
            )
        except ValueError as err:
            raise user_error(self.t("err_bad_setting", error=err)) from err

    def engine_error(self, err: EngineError) -> gr.Error:
        return user_error(self.engine_message(err))

    def engine_message(self, err: EngineError) -> str:
        """The engine's refusal or failure in the page's words and language, one sentence each: a server
        going away is not busy, a busy or starting one says when to retry, a text with nothing to speak
        says so; only a refusal of the visitor's own input quotes the engine (``err_input``). Every
        engine text also goes to the log."""
        if isinstance(err, Stopping):  # not busy: this process is going away (another may come back)
            return self.t("err_stopping")
        if isinstance(err, Busy):  # the engine's own words name its queue: the visitor needs the wait
            seconds = max(1, math.ceil(err.retry_after_s))  # the engine's estimate, as the API's Retry-After
            return self.t("err_starting" if isinstance(err, NotReady) else "err_busy", seconds=seconds)
        if isinstance(err, Unspeakable):
            return self.t("err_unspeakable")
        if isinstance(err, Forbidden):
            return self.t("err_voice_public")
        if isinstance(err, NotFound):
            return self.t("err_voice_missing")
        if isinstance(err, InvalidInput):
            return self.t("err_input", error=str(err))
        return self.t("err_internal")

    # ---- generate / stop -----------------------------------------------------------------------------
    async def generate(self, form: Form) -> AsyncIterator[tuple[Any, ...]]:
        """Yields (final audio, metrics html, status html, history, history html) per chunk, then the file.

        ``form.rid`` is drawn by the browser at click time so its live player can ask for the PCM before
        this handler runs; with streaming on every chunk's PCM is published to the hub under that id.
        ``form.live``: the text box feeds the engine while it is written (``live_text.py``), at ``form.wps``
        words per second.
        """
        rid = form.rid if RID.match(form.rid) else new_request_id()
        form = replace(form, rid=rid, live=bool(form.live) and form.mode != "vc")
        try:  # the browser's player is waiting on rid: a bad input must close it too
            req = self.build_request(form)
        except gr.Error as err:
            self.hub.close(rid)
            yield self.refused(str(err.message))
            return
        try:
            lexicon = await self.lexicon(form.lexicon, form.browser_id)
        except gr.Error as err:
            self.hub.close(rid)
            yield self.refused(str(err.message))
            return
        applier = StreamApplier(lexicon) if lexicon is not None else None
        if form.live:
            feed = self.live.open(rid, form.text, max(1.0, float(form.wps or 4.0)))
            pieces = feed.pieces()
            req = replace(req, text="", text_stream=pronounced(pieces, applier) if applier else pieces)
        typed = req.text  # the history shows it as typed, not with the lexicon's hints
        if applier is not None and not form.live:
            req = replace(req, text=applier.feed(req.text) + applier.end())
        updates = self._generate(req, list(form.history), lambda: self.lexicon_note(applier), typed)
        try:
            async for update in updates:
                yield update
        finally:
            await updates.aclose()  # now, not at garbage collection: its finally aborts the engine
            self.live.close(rid)

    async def live_typed(self, text: str, rid: str) -> None:
        """The text box changed: a running live-text request gets the new words (a coroutine, so Gradio
        runs it on the event loop the feed waits on, not in a worker thread)."""
        if RID.match(rid or ""):
            self.live.update(rid, text or "")

    async def _generate(
        self, req: SynthesisRequest, history: list[views.HistoryEntry], note: Callable[[], str] = str,
        typed: str = "",
    ) -> AsyncGenerator[tuple[Any, ...], None]:  # fmt: skip
        """``note``: read when the take ends, a line the final status adds (where the lexicon applied);
        ``typed``: the text as the visitor wrote it, for the history (``req.text`` may carry hints)."""
        rid = req.request_id
        parts: list[np.ndarray] = []
        last: AudioChunk | None = None
        if rid in self._stopped:  # Stop came while this event waited in Gradio's queue
            self.hub.close(rid)
            yield self.finish(req, parts, last, history, note(), typed)
            return
        if req.stream:
            self.hub.open(rid, self.engine.sample_rate)
        chunks = self.engine.stream(req)
        failure, refusal = "", False
        try:
            async for chunk in chunks:
                parts.append(chunk.pcm)
                last = chunk
                if req.stream:
                    self.hub.publish(rid, views.pcm16_bytes(chunk.pcm))
                running = self.status("running", audio=chunk.metrics.audio_s)
                yield gr.skip(), views.metrics_html(chunk.metrics, self.t), running, gr.skip(), gr.skip()
        except EngineError as err:  # a refusal or a failure the engine names
            log.warning("request %s ended by the engine: %r", rid, err)
            failure, refusal = self.engine_message(err), isinstance(err, InvalidInput)
        except Exception:  # an engine bug: its text and traceback go to the log, not to the visitor
            log.exception("request %s failed", rid)
            failure = self.t("err_internal")
        finally:
            self.hub.close(rid)
            if last is None or not last.is_last:
                self.engine.abort(rid)  # closed mid-stream (tab closed, event cancelled): free the engine
            await chunks.aclose()
        if not failure:
            yield self.finish(req, parts, last, history, note(), typed)
        elif refusal and last is None:  # its own input stops it before any audio: retrying cannot help
            yield self.refused(failure)
        else:
            yield self.failed(failure, req, parts, last, history, note(), typed)

    def refused(self, message: str) -> tuple[Any, ...]:
        """The update for a request its own inputs stop before it starts: the status says why, in red beside
        the result (as an error the event would leave the last take's "Done" under Gradio's error badge,
        and a toast would be headed "Warning" in every language)."""
        metrics = views.metrics_html(None, self.t)
        return gr.skip(), metrics, self.status("refused", message=message), gr.skip(), gr.skip()

    def failed(
        self, message: str, req: SynthesisRequest, parts: list[np.ndarray], last: AudioChunk | None,
        history: list[views.HistoryEntry], note: str = "", typed: str = "",
    ) -> tuple[Any, ...]:  # fmt: skip
        """The update that ends a failed request: a toast, and the status says so (with its Retry button,
        shown by css while the status is "failed"); the event itself succeeds, so the page is not left with
        Gradio's error state on the status. Audio made before the failure is kept, as Stop keeps it: the
        result plays it and the history lists it (marked failed) with its downloads."""
        gr.Warning(message)
        metrics = views.metrics_html(last.metrics if last is not None else None, self.t)
        if last is None or not any(len(p) for p in parts):
            return gr.skip(), metrics, self.status("failed", message=message), gr.skip(), gr.skip()
        path = self.store.save(req.request_id, np.concatenate(parts), self.engine.sample_rate)
        history = [*(history or []), self.history_entry(req, last.metrics, True, True, typed)][-MAX_HISTORY:]
        status = self.status("failed", "failed_kept", note, message=message, audio=last.metrics.audio_s)
        audio = gr.update(value=str(path), autoplay=False)
        return audio, metrics, status, history, self.history_view(history)

    def finish(
        self, req: SynthesisRequest, parts: list[np.ndarray], last: AudioChunk | None,
        history: list[views.HistoryEntry], note: str = "", typed: str = "",
    ) -> tuple[Any, ...]:  # fmt: skip
        """The final update: the whole file. Never autoplayed: the live player played the stream, and with
        streaming off it plays this file itself (``player.FINISHED_JS``)."""
        metrics = last.metrics if last is not None else RequestMetrics(request_id=req.request_id)
        stopped = last is None or not last.is_last
        if not parts or sum(len(p) for p in parts) == 0:
            return (
                None,
                views.metrics_html(metrics, self.t),
                self.status("stopped", note=note, audio=0.0),
                history,
                gr.skip(),
            )
        path = self.store.save(req.request_id, np.concatenate(parts), self.engine.sample_rate)
        entry = self.history_entry(req, metrics, stopped, typed=typed)
        history = [*(history or []), entry][-MAX_HISTORY:]
        status = self.status("stopped", note=note, audio=metrics.audio_s) if stopped else self.status(
            "done", note=note, audio=metrics.audio_s, seed=metrics.seed
        )  # fmt: skip
        audio = gr.update(value=str(path), autoplay=False)
        return (audio, views.metrics_html(metrics, self.t), status, history, self.history_view(history))

    def history_entry(
        self, req: SynthesisRequest, m: RequestMetrics, stopped: bool, failed: bool = False, typed: str = ""
    ) -> views.HistoryEntry:
        """``typed``: the text as written (``req.text`` may carry a lexicon's hints); ``req.text`` if none."""
        voice = req.voice_id or (self.prompt_name(req.prompt_wav) if req.prompt_wav else "—")
        mode = "voice" if req.voice_id else str(req.mode)
        return views.HistoryEntry(
            request_id=req.request_id, created_at=time.time(), mode=mode, text=typed or req.text,
            language=req.language, voice=voice, speed=req.speed, seed=m.seed, stream=req.stream,
            ttfa_ms=m.ttfa_ms, rtf=m.rtf, audio_s=m.audio_s, stopped=stopped, failed=failed,
        )  # fmt: skip

    def prompt_name(self, path: str) -> str:
        """The example voice a prompt file is ("en-amy"), or "upload". Gradio hands the handler its own
        cached copy of an example's file, under the example's file name: the name and the bytes must both
        match, so an upload that happens to share a name stays an upload."""
        given = Path(path)
        for ex in self.engine.example_voices():
            wav = Path(ex.wav)
            if wav.name == given.name and _same_bytes(wav, given):
                return str(ex.name)
        return "upload"

    def restore_history(self, kept: Any) -> tuple[list[views.HistoryEntry], str]:
        """On load: the history the browser kept (``keep.js``, JSON) -> (the history state, its table).
        Whatever does not read as entries is dropped: the browser's storage is the visitor's to edit."""
        history = views.history_from_json(kept)[-MAX_HISTORY:]
        return history, self.history_view(history)

    def stop(self, rid: str) -> None:
        """Abort the engine request: its stream ends, and ``generate`` keeps the audio made so far.

        Not Gradio's ``cancels``, which would only drop the listener (and the partial audio); a request still
        waiting in Gradio's queue is remembered and ends as soon as it starts. It writes no status: its reply
        and Generate's last update race over two connections, and a "stop sent" landing second would hide
        "stopped" (the live player shows "stopped" at the click).
        """
        if RID.match(rid or ""):
            self._stopped[rid] = None
            while len(self._stopped) > 1024:
                self._stopped.popitem(last=False)
            self.engine.abort(rid)
            self.hub.close(rid)

    def was_stopped(self, rid: str) -> bool:
        """Stop was pressed for this request id (the script desk's performance reads it between pieces)."""
        return bool(rid) and rid in self._stopped

    def status(self, state: str, key: str = "", note: str = "", **fields: Any) -> str:
        """The status line in ``state`` (css and the page's scripts read it), worded by ``key`` (the
        state's own words by default); ``note``: a second line (where the lexicon applied)."""
        text = html.escape(self.t(f"status_{key or state}", **fields))
        extra = f'<span class="cosy-lexicon-note">{html.escape(note)}</span>' if note else ""
        return f'<div class="cosy-status" data-state="{state}">{text}{extra}</div>'

    # ---- pronunciation lexicons (``engine.lexicons``: the public ones and the browser's own) ----------
    def lexicon_store(self) -> LexiconLibrary | None:
        store = getattr(self.engine, "lexicons", None)
        return store if isinstance(store, LexiconLibrary) else None

    async def lexicon(self, lexicon_id: str, browser_id: str | None) -> Lexicon | None:
        """The picked lexicon (None for none); ``gr.Error`` when it is gone, not this browser's, or the
        server keeps none."""
        if not lexicon_id:
            return None
        store = self.lexicon_store()
        if store is None:
            raise user_error(self.t("err_no_lexicons"))
        try:
            return await asyncio.to_thread(store.get, lexicon_id, owner_of(browser_id))
        except EngineError as err:
            log.info("lexicon %r refused: %s", lexicon_id, err)
            raise user_error(self.t("err_lexicon", error=str(err))) from err

    def lexicon_note(self, applier: StreamApplier | None) -> str:
        """Where the lexicon applied, "Nike×1, 行×2" (empty without a lexicon)."""
        return lexicon_note(self.t, applier.hits) if applier is not None else ""

    async def lexicon_choices(self, browser_id: str | None = None) -> list[tuple[str, str]]:
        """("none", "") first, then the public lexicons and the browser's own, by name."""
        store = self.lexicon_store()
        found = await asyncio.to_thread(store.list, owner_of(browser_id)) if store is not None else []
        mine = [(x.name if not x.public else self.t("lexicon_public", name=x.name), x.id) for x in found]
        return [(self.t("lexicon_none"), ""), *mine]

    async def pick_lexicon(self, wanted: str, browser_id: str | None) -> Any:
        """The lab's "Use in studio": the picker on ``wanted`` (an id) where this browser has it, else as
        it was (a lexicon deleted since, or another browser's, is not picked)."""
        choices = await self.lexicon_choices(browser_id)
        known = wanted if wanted and wanted in [value for _, value in choices] else None
        return gr.Dropdown(choices=choices) if known is None else gr.Dropdown(choices=choices, value=known)

    async def browser_lexicons(self, browser_id: str | None, kept_lexicon: str = "") -> tuple[Any, str]:
        """On load, with the browser's id (OWNER_JS): (the Pronunciation picker's choices, a note).

        ``kept_lexicon``: the lexicon this browser picked last (``keep.js``); picked again only while the
        list still has it, else the picker stays on None and the note says the lexicon is gone."""
        choices = await self.lexicon_choices(browser_id)
        value, note = self._kept_pick(choices, kept_lexicon, "lexicon_not_kept", "lexicon")
        if value is None and not note:  # nothing was kept: the picker as it comes
            return gr.Dropdown(choices=choices), ""
        return gr.Dropdown(choices=choices, value=value or ""), note

    def history_view(self, history: list[views.HistoryEntry]) -> str:
        return views.history_html(history or [], self.t, self.mode_labels)

    # ---- small listeners -----------------------------------------------------------------------------
    def prompt_info(self, path: str | None) -> str:
        if not path:
            return views.prompt_status_html(None, 0, self.prompt_min_s, self.limits.max_prompt_s, self.t)
        try:
            seconds, rate = audio_seconds(path)
        except Exception as err:  # shown as a note; Generate raises the same as gr.Error
            log.info("prompt audio unreadable: %r", err)
            return views.note_html(self.t("prompt_unreadable"), "bad")
        return views.prompt_status_html(seconds, rate, self.prompt_min_s, self.limits.max_prompt_s, self.t)

    def text_info(self, text: str, language: str) -> tuple[str, str]:
        """Character counter and split preview: the engine's own normalised segments when it offers them."""
        preview = getattr(self.engine, "split_preview", None)
        try:
            segments = preview(text or "", language) if preview else views.split_text(text or "", language)
        except EngineError:  # e.g. an unknown language: the preview stays empty, Generate explains
            segments = []
        limit = self.limits.max_text_chars
        return views.counter_text(text or "", limit, len(segments), self.t), views.split_preview_html(
            segments
        )

    @staticmethod
    def dice() -> int:
        return random.randrange(2**31)

    @staticmethod
    def pick_preset(preset: str | None) -> Any:
        return preset if preset else gr.skip()

    # ---- saved voices (the browser's own, the public ones, the examples) -----------------------------
    def browser_owner(self, browser_id: str | None) -> str:
        owner = owner_of(browser_id)
        if owner is None:
            raise user_error(self.t("err_no_browser_id"))
        return owner

    async def voice_choices(self, browser_id: str | None = None) -> list[tuple[str, str]]:
        voices = await call_engine(self.engine.list_voices, owner_of(browser_id))
        return views.voice_choices(voices, self.t)

    async def voice_dropdown(self, browser_id: str | None = None) -> Any:
        return gr.Dropdown(choices=await self.voice_choices(browser_id))

    async def browser_voices(self, browser_id: str | None, kept_voice: str = "") -> tuple[str, Any, str]:
        """On load, after OWNER_JS put the browser's id in the input: (the id for the hidden field, the
        saved-voice list this browser (or this login: never written into the page) may use, a note).

        ``kept_voice``: the saved voice this browser picked last (``keep.js``); picked again only while the
        list still has it, else the list stays unpicked and the note says the voice is gone."""
        known = browser_id if browser_id and owner_of(browser_id) else ""
        choices = await self.voice_choices(known)
        value, note = self._kept_pick(choices, kept_voice, "voice_not_kept", "voice")
        picked = gr.Dropdown(choices=choices, value=value)
        return ("" if isinstance(known, Account) else known), picked, note

    def _kept_pick(
        self, choices: list[tuple[str, str]], kept: object, gone_text: str, field: str
    ) -> tuple[str | None, str]:
        """A pick this browser kept (``keep.js``) -> (it, "") while ``choices`` still lists it, else (None,
        a note in ``gone_text`` naming it as ``field``); (None, "") when nothing was kept."""
        wanted = kept.strip() if isinstance(kept, str) else ""
        if not wanted:
            return None, ""
        if wanted in {value for _, value in choices}:
            return wanted, ""
        return None, views.note_html(self.t(gone_text, **{field: wanted}), "bad")

    async def save_voice(
        self, name: str, prompt_wav: str | None, prompt_text: str, browser_id: str = ""
    ) -> tuple[Any, str]:
        """Save the prompt as a voice -> (the voice dropdown, a note); a refusal is the note's, in red
        (as an error the event would cover the dropdown with Gradio's error badge)."""
        return await _noted(self._save_voice(name, prompt_wav, prompt_text, browser_id))

    async def _save_voice(
        self, name: str, prompt_wav: str | None, prompt_text: str, browser_id: str
    ) -> tuple[Any, str]:
        owner = self.browser_owner(browser_id)
        name = (name or "").strip()
        if not name:
            raise user_error(self.t("err_no_voice_name"))
        self.check_prompt(prompt_wav)
        text = (prompt_text or "").strip()
        try:
            voice = await call_engine(self.engine.add_voice, name, prompt_wav, text, owner)
        except EngineError as err:
            raise self.engine_error(err) from err
        choices = await self.voice_choices(browser_id)
        note = views.note_html(self.t("saved_as", name=voice.name), "good")
        return gr.Dropdown(choices=choices, value=str(voice.id)), note

    async def delete_voice(self, voice_id: str | None, browser_id: str = "") -> tuple[Any, str]:
        """Delete the picked voice -> (the voice dropdown, a note); a refusal is the note's, in red (the
        listener skips the queue, where an error would show nowhere)."""
        return await _noted(self._delete_voice(voice_id, browser_id))

    async def _delete_voice(self, voice_id: str | None, browser_id: str) -> tuple[Any, str]:
        owner = self.browser_owner(browser_id)
        if not voice_id:
            raise user_error(self.t("err_no_voice"))
        try:
            await call_engine(self.engine.delete_voice, voice_id, owner)
        except EngineError as err:
            raise self.engine_error(err) from err
        note = views.note_html(self.t("deleted", name=voice_id))
        return gr.Dropdown(choices=await self.voice_choices(browser_id), value=None), note

    def example_rows(self) -> tuple[list[list[str]], list[str]]:
        """(rows of prompt wav, transcript, language, a text to speak; their labels) for ``gr.Examples``."""
        rows, labels = [], []
        for ex in self.engine.example_voices():
            language = ex.language if ex.language in LANGUAGES else "auto"
            text = SAMPLE_TEXTS.get(ex.language, SAMPLE_TEXTS["en"])
            rows.append([str(ex.wav), ex.transcript, language, text])
            labels.append(f"{ex.name}")
        return rows, labels

    # ---- transcription -------------------------------------------------------------------------------
    async def transcribe(
        self, path: str | None, language: str, transcript: str = "", typed: bool = False
    ) -> tuple[Any, Any, str]:
        """On upload or recording: (transcript field, language control, transcription note). The visitor's
        words win: a transcript they ``typed`` stays, and the note shows what was heard. The detected
        language is offered to the language control while it is on auto."""
        if not path:
            return gr.skip(), gr.skip(), ""
        if not getattr(self.engine, "asr_model", None):
            return gr.skip(), gr.skip(), views.note_html(self.t("asr_off"))
        try:
            result = await self.engine.transcribe(path, None)  # type: ignore[attr-defined]
        except EngineError as err:
            log.warning("transcribing the prompt failed: %s", err)  # the engine's words stay in the log
            return gr.skip(), gr.skip(), views.note_html(self.t("transcribe_failed"), "bad")
        code = str(result.language)
        offer = code if code in LANGUAGES and (language or "auto") == "auto" else gr.skip()
        if typed and (transcript or "").strip():
            return gr.skip(), offer, views.note_html(self.t("transcript_kept", text=str(result.text)))
        shown = language_name(code, self.t)
        key = "transcribed_noise" if self.random_weights else "transcribed"
        return str(result.text), offer, views.note_html(self.t(key, language=shown), "good")

    @staticmethod
    def transcript_cleared(typed: bool) -> tuple[Any, str]:
        """The prompt audio removed: (the transcript, the transcription note). A transcript filled for the
        removed audio goes with it; one the visitor typed stays."""
        return (gr.skip() if typed else ""), ""

    # ---- the page in the session's language -----------------------------------------------------------
    def page(self) -> tuple[Any, ...]:
        """On load: every server-rendered text and choice list in this studio's language (labels follow
        the browser through Gradio's i18n): header, mode, language, mode help, prompt note, counter,
        status, metrics, live card, instruction presets (the history: ``restore_history``, with what the
        browser kept)."""
        from webui import player

        modes = gr.update(choices=[(self.mode_labels[m], m) for m in UI_MODES])
        langs = gr.update(choices=[(self.t(f"lang_{x}"), x) for x in LANGUAGES])
        banner = self.t("banner_random") if self.random_weights else None
        return (
            views.header_html(self.t, self.chips, banner), modes, langs,
            views.mode_help_html(UI_MODES, self.t), self.prompt_info(None),
            views.counter_text("", self.limits.max_text_chars, 0, self.t), self.status("idle"),
            views.metrics_html(None, self.t), player.card_html(self.t),
            gr.update(choices=views.preset_choices(self.engine.instruct_presets(), self.t)),
        )  # fmt: skip

    # ---- server panel --------------------------------------------------------------------------------
    def server_panel(self) -> str:
        stats = self.engine.stats()
        now = time.monotonic()
        if not self._samples or now - self._samples[-1][0] >= 0.5:
            self._samples.append((now, stats.audio_s_total))
        startup = getattr(self.engine, "startup", None)  # the start-up timeline, where the engine has one
        warming = startup is not None and startup.stage() == "warming"
        return views.server_html(stats, views.throughput_rates(list(self._samples)), self.t, warming)


def lexicon_note(t: Texts, hits: Sequence[Hit]) -> str:
    """The status's line for a lexicon's ``hits``: each word and how often it applied, or that none did."""
    counts: dict[str, int] = {}
    for hit in hits:
        counts[hit.word] = counts.get(hit.word, 0) + 1
    if not counts:
        return t("lexicon_applied_none")
    return t("lexicon_applied", words=", ".join(f"{word}×{n}" for word, n in counts.items()))


async def pronounced(pieces: AsyncIterator[str], applier: StreamApplier) -> AsyncIterator[str]:
    """Live text with a lexicon applied as it arrives (a word is held back until it cannot go on)."""
    async for piece in pieces:
        if text := applier.feed(piece):
            yield text
    if rest := applier.end():
        yield rest


class Studios:
    """One ``Studio`` per UI language; ``listener(name)`` is the event function Gradio calls, which hands
    the event to the studio the request's language (or the forced ``ui_lang``) picks."""

    def __init__(
        self, studio: Studio, ui_lang: str = "auto", account: Callable[[str | None], str | None] | None = None
    ):
        self.forced = ui_lang if ui_lang in UI_LANGS else None
        self.by_lang = {lang: studio.in_language(Texts(lang)) for lang in UI_LANGS}
        self.account = account  # with a login: the session's user name -> its voice namespace

    def pick(self, request: gr.Request | None) -> Studio:
        if self.forced is not None:
            return self.by_lang[self.forced]
        headers = getattr(request, "headers", None) or {}
        return self.by_lang[browser_lang(headers.get("accept-language"))]

    def signed(self, request: gr.Request | None, at: int | None, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """With a login, the session's own namespace replaces the browser id at ``at`` (nothing the page
        sends can name one); a session no key signed (none with a login) gets no namespace."""
        if self.account is None or at is None or at >= len(args):
            return args
        owner = self.account(getattr(request, "username", None))
        return (*args[:at], Account(owner or ""), *args[at + 1 :])

    def listener(self, name: str, build: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """``request`` first: Gradio inserts it at the annotated parameter's position, the inputs follow.
        ``build``: the method takes one object built from the inputs (``Form.from_ui``)."""
        method = getattr(Studio, name)
        params = FORM_FIELDS if build else list(inspect.signature(method).parameters)[1:]  # after self
        at = params.index("browser_id") if "browser_id" in params else None
        fn: Callable[..., Any]
        if inspect.isasyncgenfunction(method):

            async def stream(request: gr.Request, *args: Any) -> AsyncIterator[Any]:
                studio = self.pick(request)
                args = self.signed(request, at, args)
                try:
                    async for out in getattr(studio, name)(*((build(*args),) if build else args)):
                        yield out
                except gr.Error as err:
                    err.title = studio.t("err_title")  # the toast's heading, in the page's language
                    raise

            fn = stream
        elif inspect.iscoroutinefunction(method):

            async def coro(request: gr.Request, *args: Any) -> Any:
                studio = self.pick(request)
                try:
                    return await getattr(studio, name)(*self.signed(request, at, args))
                except gr.Error as err:
                    err.title = studio.t("err_title")  # the toast's heading, in the page's language
                    raise

            fn = coro
        else:

            def plain(request: gr.Request, *args: Any) -> Any:
                studio = self.pick(request)
                try:
                    return getattr(studio, name)(*self.signed(request, at, args))
                except gr.Error as err:
                    err.title = studio.t("err_title")  # the toast's heading, in the page's language
                    raise

            fn = plain
        fn.__name__ = fn.__qualname__ = name  # Gradio names the event's API endpoint after it
        return fn
