"""Thin UI handlers: UI values -> ``SynthesisRequest`` -> ``engine.stream`` -> UI updates.

``Studio`` holds what the listeners share (engine, limits, labels, the live-PCM hub, the audio store); its
methods are the listener functions ``layout.py`` wires up. Input checks that need only the UI's values
happen here so a bad input fails before it queues for the GPU; everything else is the engine's to judge and
comes back as an ``engine.errors`` exception, shown as a translated ``gr.Error``. This is the only module
that raises ``gr.Error``.

Languages: ``Studios`` holds one ``Studio`` per UI language (sharing the server panel's samples and the
stopped-request ids) and hands each event to the one its request's Accept-Language picks (or the forced
``--ui-lang``). Voice ownership: the browser sends its random id (kept in localStorage, ``OWNER_JS``) with
every voice event; the studio saves, lists and deletes in that id's namespace only.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import math
import random
import re
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import gradio as gr
import numpy as np
import soundfile as sf

from engine.config import Limits
from engine.errors import Busy, EngineError, Forbidden, InvalidInput, NotFound
from engine.metrics import RequestMetrics, ServerStats
from engine.request import AudioChunk, Mode, SynthesisRequest, new_request_id
from webui import views
from webui.live_text import LiveTexts
from webui.stream_route import RID, AudioStore, StreamHub
from webui.texts import EXAMPLES, LANGUAGES, UI_LANGS, Texts, browser_lang

log = logging.getLogger(__name__)

UI_MODES = ("zero_shot", "cross_lingual", "instruct", "vc", "voice")  # "voice" = zero-shot with a saved voice
PROMPT_MIN_S = 3.0  # shorter prompts clone poorly; the engine's own floor (Limits.min_prompt_s) is lower
MAX_HISTORY = 50
BROWSER_ID = re.compile(r"^[0-9a-f]{32}$")  # 128 random bits drawn in the browser (OWNER_JS)
STUDIO_OWNER = "studio:"  # keeps browser ids apart from API keys in the voice library
# Reads the browser's id from localStorage, drawing one on the first visit (never a server-side guess).
OWNER_JS = """(current) => {
  const key = "cosystream-browser-id";
  let id = localStorage.getItem(key);
  if (!id || !/^[0-9a-f]{32}$/.test(id)) {
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    id = Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
    localStorage.setItem(key, id);
  }
  return id;
}"""
SAMPLE_TEXTS = dict(EXAMPLES)  # language -> a text to speak, for the example voices


class Engine(Protocol):
    """The part of ``engine.engine.TTSEngine`` the studio uses."""

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


def user_error(message: str) -> gr.Error:
    return gr.Error(message, print_exception=False)


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


def owner_of(browser_id: str | None) -> str | None:
    """The voice namespace of a browser id; None (public voices only) for anything not drawn by OWNER_JS."""
    return STUDIO_OWNER + browser_id if browser_id and BROWSER_ID.match(browser_id) else None


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
            raise user_error(self.t("prompt_unreadable", error=type(err).__name__)) from err
        if seconds < self.prompt_min_s:
            raise user_error(self.t("prompt_short", seconds=seconds, min_s=self.prompt_min_s))
        if seconds > self.limits.max_prompt_s:
            raise user_error(self.t("prompt_long", seconds=seconds, max_s=self.limits.max_prompt_s))

    def check_text(self, text: str) -> None:
        if not text:
            raise user_error(self.t("err_no_text"))
        if len(text) > self.limits.max_text_chars:
            raise user_error(self.t("err_text_long", chars=len(text), limit=self.limits.max_text_chars))

    def build_request(
        self, mode: str, prompt_wav: str | None, prompt_text: str, instruct_text: str, source_wav: str | None,
        voice_id: str | None, language: str, text: str, stream: bool, speed: float, seed: float | None,
        rid: str, browser_id: str = "", live: bool = False,
    ) -> SynthesisRequest:  # fmt: skip
        """Validate the UI values for ``mode`` and build the engine request (``gr.Error`` on a bad input).
        ``live``: the text comes later, as it is written (it may start empty)."""
        text, prompt_text, instruct_text = (
            (text or "").strip(),
            (prompt_text or "").strip(),
            instruct_text or "",
        )
        if mode not in UI_MODES:
            raise user_error(self.t("err_bad_setting", error=f"mode {mode!r}"))
        if mode != "vc" and not live:
            self.check_text(text)
        if mode == "voice" and not voice_id:
            raise user_error(self.t("err_no_voice"))
        if mode != "voice":
            self.check_prompt(prompt_wav)
        if mode == "zero_shot" and not prompt_text:
            raise user_error(self.t("err_no_prompt_text"))
        if mode == "instruct" and not instruct_text.strip():
            raise user_error(self.t("err_no_instruct"))
        if mode == "vc" and not source_wav:
            raise user_error(self.t("err_no_source"))
        try:
            return SynthesisRequest(
                text="" if mode == "vc" else text,
                mode=Mode.ZERO_SHOT if mode == "voice" else Mode(mode),
                prompt_wav=None if mode == "voice" else prompt_wav,
                voice_id=voice_id if mode == "voice" else None,
                voice_owner=owner_of(browser_id),
                prompt_text=prompt_text if mode == "zero_shot" else "",
                instruct_text=instruct_text.strip() if mode == "instruct" else "",
                source_wav=source_wav if mode == "vc" else None,
                language=language or "auto",
                stream=bool(stream),
                speed=float(speed),
                seed=None if seed is None or seed < 0 else int(seed),
                request_id=rid,
            )
        except ValueError as err:
            raise user_error(self.t("err_bad_setting", error=err)) from err

    def engine_error(self, err: EngineError) -> gr.Error:
        """The engine's refusal in the page's language (its own English detail in brackets)."""
        if isinstance(err, Busy):
            seconds = max(1, math.ceil(err.retry_after_s))  # the engine's estimate, as the API's Retry-After
            return user_error(self.t("err_busy", error=str(err), seconds=seconds))
        if isinstance(err, Forbidden):
            return user_error(self.t("err_voice_public"))
        if isinstance(err, NotFound):
            return user_error(self.t("err_voice_missing"))
        if isinstance(err, InvalidInput):
            return user_error(self.t("err_input", error=str(err)))
        return user_error(self.t("err_failed", error=str(err)))

    # ---- generate / stop -----------------------------------------------------------------------------
    async def generate(
        self, mode: str, prompt_wav: str | None, prompt_text: str, instruct_text: str, source_wav: str | None,
        voice_id: str | None, language: str, text: str, stream: bool, speed: float, seed: float | None,
        rid: str, history: list[views.HistoryEntry], browser_id: str = "", live: bool = False,
        wps: float = 4.0,
    ) -> AsyncIterator[tuple[Any, ...]]:  # fmt: skip
        """Yields (final audio, metrics html, status html, history, history html) per chunk, then the file.

        ``rid`` is drawn by the browser at click time so its live player can ask for the PCM before this
        handler runs; with streaming on every chunk's PCM is published to the hub under that id. ``live``:
        the text box feeds the engine while it is written (``live_text.py``), at ``wps`` words per second.
        """
        rid = rid if RID.match(rid or "") else new_request_id()
        live = bool(live) and mode != "vc"
        try:  # the browser's player is waiting on rid: a bad input must close it too
            req = self.build_request(
                mode, prompt_wav, prompt_text, instruct_text, source_wav, voice_id, language, text, stream,
                speed, seed, rid, browser_id, live,
            )  # fmt: skip
        except gr.Error:
            self.hub.close(rid)
            raise
        if live:
            feed = self.live.open(rid, text or "", max(1.0, float(wps or 4.0)))
            req = replace(req, text="", text_stream=feed.pieces())
        updates = self._generate(req, history)
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
        self, req: SynthesisRequest, history: list[views.HistoryEntry]
    ) -> AsyncGenerator[tuple[Any, ...], None]:
        rid = req.request_id
        parts: list[np.ndarray] = []
        last: AudioChunk | None = None
        if rid in self._stopped:  # Stop came while this event waited in Gradio's queue
            self.hub.close(rid)
            yield self.finish(req, parts, last, history)
            return
        if req.stream:
            self.hub.open(rid, self.engine.sample_rate)
        chunks = self.engine.stream(req)
        try:
            async for chunk in chunks:
                parts.append(chunk.pcm)
                last = chunk
                if req.stream:
                    self.hub.publish(rid, views.pcm16_bytes(chunk.pcm))
                running = self.status("running", audio=chunk.metrics.audio_s)
                yield gr.skip(), views.metrics_html(chunk.metrics, self.t), running, gr.skip(), gr.skip()
        except EngineError as err:
            raise self.engine_error(err) from err
        finally:
            self.hub.close(rid)
            if last is None or not last.is_last:
                self.engine.abort(rid)  # closed mid-stream (tab closed, event cancelled): free the engine
            await chunks.aclose()
        yield self.finish(req, parts, last, history)

    def finish(
        self, req: SynthesisRequest, parts: list[np.ndarray], last: AudioChunk | None,
        history: list[views.HistoryEntry],
    ) -> tuple[Any, ...]:  # fmt: skip
        """The final update: the whole file (not autoplayed when the live player already played it)."""
        metrics = last.metrics if last is not None else RequestMetrics(request_id=req.request_id)
        stopped = last is None or not last.is_last
        if not parts or sum(len(p) for p in parts) == 0:
            return (
                None,
                views.metrics_html(metrics, self.t),
                self.status("stopped", audio=0.0),
                history,
                gr.skip(),
            )
        path = self.store.save(req.request_id, np.concatenate(parts), self.engine.sample_rate)
        entry = self.history_entry(req, metrics, stopped)
        history = [*(history or []), entry][-MAX_HISTORY:]
        status = self.status("stopped", audio=metrics.audio_s) if stopped else self.status(
            "done", audio=metrics.audio_s, seed=metrics.seed
        )  # fmt: skip
        audio = gr.update(value=str(path), autoplay=not req.stream)
        return (audio, views.metrics_html(metrics, self.t), status, history, self.history_view(history))

    def history_entry(self, req: SynthesisRequest, m: RequestMetrics, stopped: bool) -> views.HistoryEntry:
        voice = req.voice_id or ("upload" if req.prompt_wav else "—")
        mode = "voice" if req.voice_id else str(req.mode)
        return views.HistoryEntry(
            request_id=req.request_id, created_at=time.time(), mode=mode, text=req.text,
            language=req.language, voice=voice, speed=req.speed, seed=m.seed, stream=req.stream,
            ttfa_ms=m.ttfa_ms, rtf=m.rtf, audio_s=m.audio_s, stopped=stopped,
        )  # fmt: skip

    def stop(self, rid: str) -> str:
        """Abort the engine request: its stream ends, and ``generate`` keeps the audio made so far.

        Not Gradio's ``cancels``, which would only drop the listener (and the partial audio); a request still
        waiting in Gradio's queue is remembered and ends as soon as it starts.
        """
        if RID.match(rid or ""):
            self._stopped[rid] = None
            while len(self._stopped) > 1024:
                self._stopped.popitem(last=False)
            self.engine.abort(rid)
            self.hub.close(rid)
        return self.status("stop_sent")

    def status(self, state: str, **fields: Any) -> str:
        return f'<div class="cosy-status" data-state="{state}">{self.t(f"status_{state}", **fields)}</div>'

    def history_view(self, history: list[views.HistoryEntry]) -> str:
        return views.history_html(history or [], self.t, self.mode_labels)

    # ---- small listeners -----------------------------------------------------------------------------
    def prompt_info(self, path: str | None) -> str:
        if not path:
            return views.prompt_status_html(None, 0, self.prompt_min_s, self.limits.max_prompt_s, self.t)
        try:
            seconds, rate = audio_seconds(path)
        except Exception as err:  # shown as a note; Generate raises the same as gr.Error
            return views.note_html(self.t("prompt_unreadable", error=type(err).__name__), "bad")
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

    def mode_changed(self, mode: str) -> tuple[Any, ...]:
        """Visibility of (prompt group, transcript, voice group, instruct group, source, text group, help)."""
        show = {
            "prompt": mode != "voice", "transcript": mode == "zero_shot", "voice": mode == "voice",
            "instruct": mode == "instruct", "source": mode == "vc", "text": mode != "vc",
        }  # fmt: skip
        updates = tuple(gr.update(visible=v) for v in show.values())
        return (*updates, views.note_html(self.t(f"mode_help_{mode}")))

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

    async def browser_voices(self, browser_id: str | None) -> tuple[str, Any]:
        """On load, after OWNER_JS put the browser's id in the input: (the id for the hidden field, the
        saved-voice list this browser may use)."""
        known = browser_id if browser_id and owner_of(browser_id) else ""
        return known, await self.voice_dropdown(known)

    async def save_voice(
        self, name: str, prompt_wav: str | None, prompt_text: str, browser_id: str = ""
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
    async def transcribe(self, path: str | None, language: str) -> tuple[Any, Any, str]:
        """On upload or recording: (transcript field, language control, transcription note). The detected
        language is offered to the language control while it is on auto."""
        if not path:
            return gr.skip(), gr.skip(), ""
        if not getattr(self.engine, "asr_model", None):
            return gr.skip(), gr.skip(), views.note_html(self.t("asr_off"))
        try:
            result = await self.engine.transcribe(path, None)  # type: ignore[attr-defined]
        except EngineError as err:
            note = self.t("transcribe_failed", error=str(err))
            return gr.skip(), gr.skip(), views.note_html(note, "bad")
        code = str(result.language)
        shown = self.t(f"lang_{code}") if code in LANGUAGES else code
        key = "transcribed_noise" if self.random_weights else "transcribed"
        offer = code if code in LANGUAGES and (language or "auto") == "auto" else gr.skip()
        return str(result.text), offer, views.note_html(self.t(key, language=shown), "good")

    def transcript_cleared(self) -> str:
        """The prompt audio removed: its transcription note goes with it."""
        return ""

    # ---- the page in the session's language -----------------------------------------------------------
    def page(self) -> tuple[Any, ...]:
        """On load: every server-rendered text and choice list in this studio's language (labels follow
        the browser through Gradio's i18n): header, mode, language, mode help, prompt note, counter,
        status, metrics, live card, history."""
        from webui import player

        modes = gr.update(choices=[(self.mode_labels[m], m) for m in UI_MODES])
        langs = gr.update(choices=[(self.t(f"lang_{x}"), x) for x in LANGUAGES])
        banner = self.t("banner_random") if self.random_weights else None
        return (
            views.header_html(self.t, self.chips, banner), modes, langs,
            views.note_html(self.t("mode_help_zero_shot")), self.prompt_info(None),
            views.counter_text("", self.limits.max_text_chars, 0, self.t), self.status("idle"),
            views.metrics_html(None, self.t), player.card_html(self.t), self.history_view([]),
        )  # fmt: skip

    # ---- server panel --------------------------------------------------------------------------------
    def server_panel(self) -> str:
        stats = self.engine.stats()
        now = time.monotonic()
        if not self._samples or now - self._samples[-1][0] >= 0.5:
            self._samples.append((now, stats.audio_s_total))
        return views.server_html(stats, views.throughput_rates(list(self._samples)), self.t)


class Studios:
    """One ``Studio`` per UI language; ``listener(name)`` is the event function Gradio calls, which hands
    the event to the studio the request's language (or the forced ``ui_lang``) picks."""

    def __init__(self, studio: Studio, ui_lang: str = "auto"):
        self.forced = ui_lang if ui_lang in UI_LANGS else None
        self.by_lang = {lang: studio.in_language(Texts(lang)) for lang in UI_LANGS}

    def pick(self, request: gr.Request | None) -> Studio:
        if self.forced is not None:
            return self.by_lang[self.forced]
        headers = getattr(request, "headers", None) or {}
        return self.by_lang[browser_lang(headers.get("accept-language"))]

    def listener(self, name: str) -> Callable[..., Any]:
        """``request`` first: Gradio inserts it at the annotated parameter's position, the inputs follow."""
        method = getattr(Studio, name)
        fn: Callable[..., Any]
        if inspect.isasyncgenfunction(method):

            async def stream(request: gr.Request, *args: Any) -> AsyncIterator[Any]:
                async for out in getattr(self.pick(request), name)(*args):
                    yield out

            fn = stream
        elif inspect.iscoroutinefunction(method):

            async def coro(request: gr.Request, *args: Any) -> Any:
                return await getattr(self.pick(request), name)(*args)

            fn = coro
        else:

            def plain(request: gr.Request, *args: Any) -> Any:
                return getattr(self.pick(request), name)(*args)

            fn = plain
        fn.__name__ = fn.__qualname__ = name  # Gradio names the event's API endpoint after it
        return fn
