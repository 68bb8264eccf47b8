"""Every bad input the issue lists, at every entry point (engine API, HTTP API, UI handlers, CLI), on a real
tiny engine: each gets a clear error (its message is asserted) or, where the input is merely unusual
(clipped, 192 kHz, 8 channels, a header lying about its length), valid audio; and after each case a good
request through the same entry point succeeds with nothing left running.

One table-driven test per entry point.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import html
import io
import json
import re
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr
import httpx
import numpy as np
import pytest
import soundfile as sf

import engine.__main__ as cli
from api.app import build_api
from api.auth import owner_of as api_owner
from engine.errors import InvalidInput, NotFound, TooLarge
from engine.request import Mode
from engine.serving.engine import TTSEngine
from engine.voices import OWNERS, owner_dir_name
from tests.api.support import assert_openai_error
from tests.reliability.support import (
    BAD_AUDIO,
    LIMITS,
    TEXT,
    Bounded,
    assert_serves,
    check_pcm,
    collect,
    good_request,
    good_wav,
    idle_state,
    wait_idle,
    write_bad,
)
from tests.sounds import speech_like
from webui.handlers import STUDIO_OWNER, Form, Studio
from webui.stream_route import AudioStore, StreamHub
from webui.texts import Texts

OK = "ok"  # the input is unusual but valid: the request must produce valid audio
HUGE = "x" * (LIMITS.max_text_chars + 1)
# Text that normalises to nothing: zero-width and bidi format characters, combining marks with no letter.
UNSPEAKABLE = [
    ("zero_width", "\u200b\u200c\u200d\u2060\ufeff"),
    ("combining_marks_only", " \u0301\u0302\u0303\u0301 "),
    ("format_and_marks", "\u200e\u202e\u0301\u200b"),
]
HUGE_MSG = f"{LIMITS.max_text_chars + 1} characters; the limit is {LIMITS.max_text_chars}"

# The prompt transcript and the instruction get the same checks as the text (length, Cc, Cs).
ZS, INS = {"mode": Mode.ZERO_SHOT}, {"mode": Mode.INSTRUCT}

# Expected outcome of each bad prompt file at the engine (and CLI): (error class, message) or OK.
AUDIO_EXPECT: dict[str, Any] = {
    "silent": (InvalidInput, "the audio is silent"),
    "clipped": OK,
    "over_full_scale_float": OK,
    "too_short": (InvalidInput, r"0\.30 s long; at least 1 s"),
    "too_long": (TooLarge, r"31\.0 s long; the limit is 30 s"),
    "truncated": (InvalidInput, r"0\.50 s long; at least 1 s"),
    "corrupt_header": (InvalidInput, "not a readable audio file"),
    "not_audio_text": (InvalidInput, "not a readable audio file|the file has no audio stream"),
    "not_audio_png": (InvalidInput, "no audio stream"),
    "empty_file": (InvalidInput, r"empty \(0 bytes\)"),
    "8khz": (InvalidInput, "8000 Hz; CosyVoice needs at least 16000 Hz"),
    "192khz": OK,
    "8_channels": OK,
    "nan_float": (InvalidInput, "NaN or infinite"),
    "huge_declared_wav": OK,  # libsndfile trusts the file size, not the header: 3 s are read
    "huge_declared_flac": (TooLarge, "s long; the limit is 30 s"),  # refused before allocating
    "over_upload_limit": (TooLarge, "upload limit is 4.0 MiB"),
}
assert set(AUDIO_EXPECT) == set(BAD_AUDIO)


@contextlib.contextmanager
def stays_inside(root: Path) -> Iterator[None]:
    """Whatever a voice name or upload file name says, nothing appears beside the library, and none of the
    names those inputs point at appears in /tmp or the working directory (shared with other processes, so
    only those names are watched there)."""
    before = set(root.parent.iterdir())
    yield
    assert set(root.parent.iterdir()) == before, "a file appeared beside the voice library"
    for directory in (Path(tempfile.gettempdir()), Path.cwd()):
        assert not [directory / n for n in ("evil.wav", "passwd", "etc") if (directory / n).exists()]


def assert_voice_entry(root: Path, voice_id: str) -> None:
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", voice_id), voice_id
    assert (root / voice_id).resolve().parent == root.resolve() and (root / voice_id).is_dir()


def params(table: list[Any]) -> list[Any]:
    return [pytest.param(case, id=case.id, marks=case.marks) for case in table]


# ================================================================================================ engine


@dataclass(frozen=True)
class Ctx:
    engine: TTSEngine
    prompt: Path
    bad_dir: Path


@dataclass(frozen=True)
class EngineCase:
    id: str
    act: Callable[[Ctx], Awaitable[Any]]
    expect: Any  # OK or (exception class, message regex)
    marks: tuple[Any, ...] = ()


def synth(**kw: Any) -> Callable[[Ctx], Awaitable[Any]]:
    async def act(ctx: Ctx) -> Any:
        chunks = await collect(ctx.engine, good_request(ctx.prompt, **kw))
        check_pcm(np.concatenate([c.pcm for c in chunks]))

    return act


def synth_prompt(case: str, **kw: Any) -> Callable[[Ctx], Awaitable[Any]]:
    async def act(ctx: Ctx) -> Any:
        await synth(prompt_wav=str(write_bad(ctx.bad_dir, case)), **kw)(ctx)

    return act


def synth_source(case: str) -> Callable[[Ctx], Awaitable[Any]]:
    async def act(ctx: Ctx) -> Any:
        await synth(mode=Mode.VC, text="", source_wav=str(write_bad(ctx.bad_dir, case)))(ctx)

    return act


def add_voice(name: str) -> Callable[[Ctx], Awaitable[Any]]:
    async def act(ctx: Ctx) -> Any:
        root = ctx.engine.voices.root
        with stays_inside(root):
            voice = ctx.engine.add_voice(name, str(ctx.prompt), "A prompt transcript.")
        assert_voice_entry(root, voice.id)
        ctx.engine.delete_voice(voice.id)

    return act


def delete_voice(voice_id: str) -> Callable[[Ctx], Awaitable[Any]]:
    async def act(ctx: Ctx) -> Any:
        ctx.engine.delete_voice(voice_id)

    return act


ENGINE_CASES = [
    EngineCase("empty_text", synth(text=""), (InvalidInput, "text to speak is empty")),
    EngineCase("whitespace_text", synth(text=" \n\t\u3000 "), (InvalidInput, "text to speak is empty")),
    EngineCase("huge_text", synth(text=HUGE), (TooLarge, HUGE_MSG)),
    EngineCase("binary_text", synth(text="\x00\x01\x02\xff\xfe"), (InvalidInput, "control characters")),
    EngineCase("escape_sequence_text", synth(text="Hi \x1b[31m red"), (InvalidInput, "control characters")),
    EngineCase("c1_control_text", synth(text="Hi \x85\x9b there"), (InvalidInput, "control characters")),
    EngineCase("lone_surrogate_text", synth(text="Hi \ud800 there"), (InvalidInput, "Unicode")),
    EngineCase("nothing_to_speak", synth(text="...!!!"), (InvalidInput, "nothing to speak")),
    *(
        EngineCase(f"{kind}_text", synth(text=text), (InvalidInput, "nothing to speak"))
        for kind, text in UNSPEAKABLE
    ),
    *(
        EngineCase(f"{field}_{kind}", synth(**(mode | {field: value})), expect)
        for field, mode in (("prompt_text", ZS), ("instruct_text", INS))
        for kind, value, expect in (
            ("control", "Say \x00\x1b it", (InvalidInput, "control characters")),
            ("lone_surrogate", "Say \ud800 it", (InvalidInput, "Unicode")),
            ("huge", HUGE, (TooLarge, HUGE_MSG)),
        )
    ),
    EngineCase("unknown_mode", synth(mode="sing"), (ValueError, "'sing' is not a valid Mode")),
    EngineCase(
        "instruct_without_instruction", synth(mode=Mode.INSTRUCT), (InvalidInput, "needs an instruction")
    ),
    EngineCase(
        "zero_shot_without_transcript", synth(mode=Mode.ZERO_SHOT), (InvalidInput, "needs the transcript")
    ),
    EngineCase("vc_without_source", synth(mode=Mode.VC, text=""), (InvalidInput, "needs the source speech")),
    EngineCase("no_voice", synth(prompt_wav=None), (InvalidInput, "a voice is needed")),
    EngineCase("speed_out_of_range", synth(speed=9.0), (ValueError, r"speed must be within \[0.5, 2.0\]")),
    EngineCase(
        "unknown_voice_id",
        synth(prompt_wav=None, voice_id="nobody"),
        (NotFound, "no saved voice with id 'nobody'"),
    ),
    EngineCase(
        "voice_id_dotdot",
        synth(prompt_wav=None, voice_id="../etc/passwd"),
        (InvalidInput, "invalid voice id"),
    ),
    EngineCase(
        "voice_id_absolute",
        synth(prompt_wav=None, voice_id="/etc/passwd"),
        (InvalidInput, "invalid voice id"),
    ),
    EngineCase(
        "voice_id_nul", synth(prompt_wav=None, voice_id="alice\x00"), (InvalidInput, "invalid voice id")
    ),
    EngineCase(
        "voice_id_very_long", synth(prompt_wav=None, voice_id="a" * 300), (InvalidInput, "invalid voice id")
    ),
    EngineCase("delete_voice_dotdot", delete_voice("../voices"), (InvalidInput, "invalid voice id")),
    EngineCase(
        "prompt_file_missing", synth(prompt_wav="/nonexistent/p.wav"), (InvalidInput, "audio file not found")
    ),
    *(EngineCase(f"prompt_{case}", synth_prompt(case), AUDIO_EXPECT[case]) for case in BAD_AUDIO),
    EngineCase(
        "prompt_array_nan",
        synth(prompt_wav=None, prompt_audio=(np.full(48000, np.nan, np.float32), 16000)),
        (InvalidInput, "NaN or infinite"),
    ),
    EngineCase(
        "prompt_array_8_channels_first",
        synth(prompt_wav=None, prompt_audio=(np.stack([speech_like(3.0, 16000)] * 8), 16000)),
        OK,
    ),
    EngineCase("vc_source_8khz", synth_source("8khz"), (InvalidInput, "8000 Hz")),
    EngineCase("voice_name_dotdot", add_voice("../../etc/passwd"), OK),
    EngineCase("voice_name_absolute", add_voice("/etc/passwd"), OK),
    EngineCase("voice_name_nul", add_voice("bad\x00name"), (InvalidInput, "voice name contains control")),
    EngineCase("voice_name_very_long", add_voice("n" * 500), (InvalidInput, "500 characters; at most 64")),
    EngineCase("voice_name_empty", add_voice("  "), (InvalidInput, "voice name is empty")),
]


@pytest.mark.parametrize("case", params(ENGINE_CASES))
async def test_engine_api_bad_inputs(engine, prompt, bad_dir, case: EngineCase):
    ctx = Ctx(engine, prompt, bad_dir)
    if case.expect == OK:
        await case.act(ctx)
    else:
        error, message = case.expect
        with pytest.raises(error, match=message):
            await case.act(ctx)
    assert await wait_idle(engine), idle_state(engine)
    await assert_serves(engine, prompt)


# ================================================================================================== HTTP


@dataclass(frozen=True)
class HttpCase:
    id: str
    request: Callable[[Path], dict[str, Any]]  # bad-audio dir -> httpx.request kwargs (built lazily)
    status: int
    match: str
    marks: tuple[Any, ...] = ()
    param: str | None = None  # the OpenAI error's ``param``: the field at fault, where there is one
    code: str | None = None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


GOOD_REF = b64(good_wav())


def speech(**fields: Any) -> Callable[[Path], dict[str, Any]]:
    voice = {"ref_audio": None} if "voice" in fields else {"ref_audio": GOOD_REF}  # ref_audio wins
    body = {"input": TEXT, "mode": "cross_lingual", "stream": False, "seed": 1} | voice | fields
    body = {k: v for k, v in body.items() if v is not None}
    return speech_raw(json.dumps(body).encode())  # ASCII JSON: a lone surrogate travels as \\udXXX


def speech_raw(content: bytes) -> Callable[[Path], dict[str, Any]]:
    headers = {"content-type": "application/json"}
    return lambda _: {"method": "POST", "url": "/v1/audio/speech", "content": content, "headers": headers}


def speech_ref(case: str) -> Callable[[Path], dict[str, Any]]:
    def build(bad_dir: Path) -> dict[str, Any]:
        ref = b64(write_bad(bad_dir, case).read_bytes())
        return speech(ref_audio=ref)(bad_dir)

    return build


def new_voice(
    name: str, audio: str | None = None, filename: str = "p.wav", text: str = "Hi."
) -> Callable[[Path], dict[str, Any]]:
    def build(bad_dir: Path) -> dict[str, Any]:
        data = write_bad(bad_dir, audio).read_bytes() if audio else good_wav()
        files = {"audio_sample": (filename, data, "audio/wav")}
        return {
            "method": "POST",
            "url": "/v1/audio/voices",
            "data": {"name": name, "ref_text": text},
            "files": files,
        }

    return build


def delete(voice_id: str) -> Callable[[Path], dict[str, Any]]:
    return lambda _: {"method": "DELETE", "url": f"/v1/audio/voices/{voice_id}"}


# Status of each bad ref_audio: the engine's error as api.errors maps it (TooLarge 413, InvalidInput 422).
HTTP_AUDIO = {
    case: (200, "") if expect == OK else (413 if expect[0] is TooLarge else 422, expect[1])
    for case, expect in AUDIO_EXPECT.items()
}
HTTP_AUDIO["empty_file"] = (422, "a voice is needed")  # "" is no ref_audio at all
HTTP_AUDIO["over_upload_limit"] = (413, "ref_audio is over the upload limit of 4194304 bytes")

HTTP_CASES = [
    HttpCase("empty_input", speech(input=""), 422, "input is empty", param="input"),
    HttpCase("whitespace_input", speech(input=" \n\t "), 422, "input is empty"),
    HttpCase("huge_input", speech(input=HUGE), 413, f"input has {HUGE_MSG}"),
    HttpCase("binary_input", speech(input="\x00\x01\x02\xff\xfe"), 422, "control characters"),
    HttpCase("escape_sequence_input", speech(input="Hi \x1b[31m red"), 422, "control characters"),
    HttpCase("c1_control_input", speech(input="Hi \x85\x9b there"), 422, "control characters"),
    HttpCase("lone_surrogate_input", speech(input="Hi \ud800 there"), 422, "Unicode"),
    HttpCase("nothing_to_speak", speech(input="...!!!"), 422, "nothing to speak"),
    *(HttpCase(f"{kind}_input", speech(input=text), 422, "nothing to speak") for kind, text in UNSPEAKABLE),
    HttpCase("missing_input", speech(input=None), 422, "input: Field required"),
    HttpCase("huge_instructions", speech(mode="instruct", instructions=HUGE), 413, "instructions has"),
    HttpCase("huge_ref_text", speech(mode="zero_shot", ref_text=HUGE), 413, "ref_text has"),
    HttpCase(
        "lone_surrogate_ref_text",
        speech(mode="zero_shot", ref_text="Say \ud800 it"),
        422,
        "Unicode",
    ),
    HttpCase(
        "control_instructions",
        speech(mode="instruct", instructions="Say \x00 it"),
        422,
        "control characters",
    ),
    HttpCase(
        "unknown_model",
        speech(model="gpt-9"),
        404,
        r"model 'gpt-9' is not served here; use .*tts-1, tts-1-hd, gpt-4o-mini-tts",
        param="model",
    ),
    HttpCase(
        "unknown_language", speech(language="klingon"), 422, "unknown language 'klingon'", param="language"
    ),
    HttpCase("unknown_mode", speech(mode="sing"), 422, "mode: Input should be"),
    HttpCase(
        "unknown_response_format", speech(response_format="xyz"), 422, "response_format: Input should be"
    ),
    HttpCase("unknown_stream_format", speech(stream_format="xyz"), 422, "stream_format: Input should be"),
    HttpCase("speed_out_of_range", speech(speed=9), 422, "speed: Input should be less than or equal to 4"),
    HttpCase("negative_seed", speech(seed=-1), 422, "seed: Input should be greater than or equal to 0"),
    HttpCase(
        "unknown_voice",
        speech(voice="nobody"),
        404,
        "no saved voice with id 'nobody'",
        param="voice",
        code="voice_not_found",
    ),
    HttpCase("voice_dotdot", speech(voice="../etc/passwd"), 422, "invalid voice id", param="voice"),
    HttpCase("voice_absolute", speech(voice="/etc/passwd"), 422, "invalid voice id"),
    HttpCase("voice_nul", speech(voice="alice\x00"), 422, "invalid voice id"),
    HttpCase("voice_very_long", speech(voice="a" * 300), 422, "invalid voice id"),
    HttpCase("voice_object_dotdot", speech(voice={"id": "../x"}), 422, "invalid voice id", param="voice"),
    *(HttpCase(f"ref_audio_{case}", speech_ref(case), *HTTP_AUDIO[case]) for case in BAD_AUDIO),
    HttpCase(
        "ref_audio_not_base64", speech(ref_audio="!!not base64!!"), 400, "ref_audio is not valid base64"
    ),
    HttpCase("ref_audio_url", speech(ref_audio="file:///etc/passwd"), 400, "URLs are not fetched"),
    HttpCase("ref_audio_bad_data_url", speech(ref_audio="data:audio/wav,abc"), 400, "base64 data URL"),
    HttpCase(
        "vc_source_nan",
        lambda d: speech(mode="vc", input="", source_audio=b64(write_bad(d, "nan_float").read_bytes()))(d),
        422,
        "NaN",
    ),
    HttpCase("invalid_json", speech_raw(b'{"input": "Hi", '), 400, "not valid JSON"),
    HttpCase("body_over_cap", speech_raw(b" " * 12_000_000), 413, "request body is over the limit"),
    HttpCase("voice_name_dotdot", new_voice("../../etc/passwd"), 201, ""),
    HttpCase("voice_name_absolute", new_voice("/etc/passwd"), 201, ""),
    HttpCase(
        "voice_upload_filename_dotdot", new_voice("alice", filename="../../../../tmp/evil.wav"), 201, ""
    ),
    HttpCase("voice_name_nul", new_voice("bad\x00name"), 422, "voice name contains control characters"),
    HttpCase("voice_name_very_long", new_voice("n" * 500), 422, "name must have 1-64 characters"),
    HttpCase("voice_name_empty", new_voice("  "), 422, "name must have 1-64 characters"),
    HttpCase("voice_audio_not_audio", new_voice("bob", "not_audio_text"), 422, "not a readable audio file"),
    HttpCase("voice_audio_nan", new_voice("bob", "nan_float"), 422, "NaN"),
    HttpCase("voice_without_transcript", new_voice("bob", text=""), 422, "ref_text"),
    HttpCase("delete_voice_bad_id", delete("UPPER"), 422, "invalid voice id", param="voice_id"),
    HttpCase("delete_voice_dotdot", delete("..%2F..%2Fetc"), 404, "no route", code="unknown_route"),
    HttpCase(
        "delete_voice_unknown",
        delete("nobody"),
        404,
        "no saved voice",
        param="voice_id",
        code="voice_not_found",
    ),
]


@pytest.fixture
async def http(engine) -> AsyncIterator[httpx.AsyncClient]:
    app = build_api(Bounded(engine), LIMITS, api_key="")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test", timeout=30) as client:
        yield client


async def http_serves(client: httpx.AsyncClient, prompt: Path) -> None:
    r = await client.request(**speech()(prompt))
    assert r.status_code == 200, r.text
    pcm, sr = sf.read(io.BytesIO(r.content), dtype="float32")
    assert sr == 24000
    check_pcm(pcm)


def check_http(case: HttpCase, r: httpx.Response, engine: TTSEngine) -> None:
    if case.status == 201:
        assert r.status_code == 201, r.text
        voice_id = r.json()["id"]
        anonymous = api_owner(None)  # the API without keys: one anonymous caller's namespace
        assert_voice_entry(engine.voices.root / OWNERS / owner_dir_name(anonymous), voice_id)
        engine.delete_voice(voice_id, anonymous)
    elif case.status == 200:
        assert r.status_code == 200, r.text
        check_pcm(sf.read(io.BytesIO(r.content), dtype="float32")[0])
    else:
        assert r.status_code == case.status, (r.status_code, r.headers.get("content-type"), r.content[:200])
        error = assert_openai_error(r, case.status)
        assert re.search(case.match, error["message"]), error["message"]
        assert case.param is None or error["param"] == case.param, error
        assert case.code is None or error["code"] == case.code, error
        if case.status == 429:
            assert "retry-after" in r.headers


@pytest.mark.parametrize("case", params(HTTP_CASES))
async def test_http_api_bad_inputs(engine, http, prompt, bad_dir, case: HttpCase):
    with stays_inside(engine.voices.root):
        r = await http.request(**case.request(bad_dir))
    check_http(case, r, engine)
    assert await wait_idle(engine), idle_state(engine)
    await http_serves(http, prompt)


# ==================================================================================================== UI


@dataclass(frozen=True)
class UiCase:
    id: str
    action: str  # generate | save | delete
    values: dict[str, Any] = field(default_factory=dict)
    match: str = OK  # gr.Error message regex, or OK
    marks: tuple[Any, ...] = ()


def ui_values(prompt: str, **over: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "mode": "cross_lingual",
        "prompt_wav": prompt,
        "prompt_text": "",
        "instruct_text": "",
        "source_wav": None,
        "voice_id": None,
        "language": "auto",
        "text": TEXT,
        "stream": True,
        "speed": 1.0,
        "seed": 1,
        "rid": "0" * 32,
        "history": (),
    }
    return values | over


# What the UI says about each bad prompt file: its own duration check first (3-30 s, via the header),
# then the engine's message for what only decoding finds.
UI_AUDIO = {
    "silent": "the audio is silent",
    "clipped": OK,
    "too_short": r"0\.3 s: too short, use at least 3 s",
    "too_long": r"31\.0 s: too long, use at most 30 s",
    "truncated": r"0\.5 s: too short",
    "corrupt_header": "could not be read; try",  # no decoder's class name: that goes to the log
    "not_audio_text": "could not be read; try",
    "not_audio_png": "could not be read; try",
    "empty_file": "could not be read; try",
    "8khz": "8000 Hz; CosyVoice needs at least 16000 Hz",
    "192khz": OK,
    "8_channels": OK,
    "nan_float": "NaN or infinite",
    "huge_declared_wav": OK,
    "huge_declared_flac": "too long, use at most 30 s",
    "over_upload_limit": "too long, use at most 30 s",  # 87 s: the duration check comes first
}

UI_CASES = [
    UiCase("empty_text", "generate", {"text": ""}, "The text is empty"),
    UiCase("whitespace_text", "generate", {"text": " \n\t "}, "The text is empty"),
    *(UiCase(f"{kind}_text", "generate", {"text": text}, "nothing to speak") for kind, text in UNSPEAKABLE),
    UiCase("huge_text", "generate", {"text": HUGE}, "501 characters; the limit is 500"),
    UiCase("binary_text", "generate", {"text": "\x00\x01\x02\xff\xfe"}, "control characters"),
    UiCase("escape_sequence_text", "generate", {"text": "Hi \x1b[31m red"}, "control characters"),
    UiCase("c1_control_text", "generate", {"text": "Hi \x85\x9b there"}, "control characters"),
    UiCase("lone_surrogate_text", "generate", {"text": "Hi \ud800 there"}, "Unicode"),
    UiCase("unknown_mode", "generate", {"mode": "sing"}, "Invalid setting: mode 'sing'"),
    UiCase("unknown_language", "generate", {"language": "klingon"}, "unknown language 'klingon'"),
    UiCase(
        "lone_surrogate_prompt_text",
        "generate",
        {"mode": "zero_shot", "prompt_text": "Say \ud800 it"},
        "Unicode",
    ),
    UiCase(
        "control_instruction",
        "generate",
        {"mode": "instruct", "instruct_text": "Say \x00 it"},
        "control characters",
    ),
    UiCase("speed_out_of_range", "generate", {"speed": 9.0}, "Invalid setting: speed must be within"),
    UiCase("no_prompt", "generate", {"prompt_wav": None}, "A prompt voice is needed"),
    UiCase("prompt_path_missing", "generate", {"prompt_wav": "/nonexistent/p.wav"}, "could not be read"),
    UiCase(
        "unknown_voice",
        "generate",
        {"mode": "voice", "voice_id": "nobody"},
        "gone or not yours",  # the engine's NotFound, in the page's language
    ),
    UiCase("voice_dotdot", "generate", {"mode": "voice", "voice_id": "../etc/passwd"}, "invalid voice id"),
    UiCase("voice_very_long", "generate", {"mode": "voice", "voice_id": "a" * 300}, "invalid voice id"),
    *(UiCase(f"prompt_{case}", "generate", {"prompt_wav": case}, UI_AUDIO[case]) for case in UI_AUDIO),
    UiCase("voice_name_dotdot", "save", {"name": "../../etc/passwd"}),
    UiCase("voice_name_absolute", "save", {"name": "/etc/passwd"}),
    UiCase("voice_name_nul", "save", {"name": "bad\x00name"}, "voice name contains control characters"),
    UiCase("voice_name_very_long", "save", {"name": "n" * 500}, "500 characters; at most 64"),
    UiCase("voice_name_empty", "save", {"name": " "}, "Give the voice a name first"),
    UiCase("delete_voice_dotdot", "delete", {"voice_id": "../voices"}, "invalid voice id"),
]


BROWSER = "c3" * 16  # a browser id as the page's script draws it


@pytest.fixture
def studio(engine, tmp_path) -> Studio:
    return Studio(Bounded(engine), LIMITS, Texts("en"), StreamHub(), AudioStore(tmp_path / "store"))


class PageFailed(Exception):
    """The request ended with the page's "failed" status (the engine refused it) or "refused" (its inputs
    did), or a voice listener's red note; the message is the text the visitor reads."""


async def ui_generate(studio: Studio, values: dict[str, Any]) -> np.ndarray:
    outputs = [out async for out in studio.generate(Form(**values))]
    audio, status = outputs[-1][0], outputs[-1][2]
    if 'data-state="failed"' in status or 'data-state="refused"' in status:
        raise PageFailed(html.unescape(status))
    assert outputs[-1][2].count('data-state="done"') == 1, outputs[-1][2]
    return sf.read(audio["value"], dtype="float32")[0]


def voice_outcome(outputs: tuple[Any, str]) -> Any:
    """A voice listener's dropdown; its refusal (a red note beside the button) raised as PageFailed."""
    dropdown, note = outputs
    if "cosy-bad" in note:
        raise PageFailed(html.unescape(note))
    return dropdown


async def ui_action(studio: Studio, case: UiCase, prompt: Path, bad_dir: Path) -> None:
    values = dict(case.values)
    if case.action == "save":
        root = studio.engine.voices.root
        with stays_inside(root):
            saved = await studio.save_voice(values["name"], str(prompt), "A transcript.", BROWSER)
        dropdown = voice_outcome(saved)
        assert_voice_entry(root / OWNERS / owner_dir_name(STUDIO_OWNER + BROWSER), dropdown.value)
        voice_outcome(await studio.delete_voice(dropdown.value, BROWSER))
    elif case.action == "delete":
        voice_outcome(await studio.delete_voice(values["voice_id"], BROWSER))
    else:
        if values.get("prompt_wav") in UI_AUDIO:
            values["prompt_wav"] = str(write_bad(bad_dir, values["prompt_wav"]))
        check_pcm(await ui_generate(studio, ui_values(str(prompt)) | values))


@pytest.mark.parametrize("case", params(UI_CASES))
async def test_ui_handlers_bad_inputs(engine, studio, ui_prompt, bad_dir, case: UiCase):
    prompt = ui_prompt
    if case.match == OK:
        await ui_action(studio, case, prompt, bad_dir)
    else:
        with pytest.raises((gr.Error, PageFailed), match=case.match):
            await ui_action(studio, case, prompt, bad_dir)
    assert await wait_idle(engine), idle_state(engine)
    check_pcm(await ui_generate(studio, ui_values(str(prompt), rid="1" * 32)))


# =================================================================================================== CLI


@dataclass(frozen=True)
class CliCase:
    id: str
    args: list[str]  # "{prompt}", "{out}", "{bad:<case>}" are filled in
    match: str  # stderr regex (rc 2), or OK (rc 0)
    marks: tuple[Any, ...] = ()


def synth_args(*extra: str) -> list[str]:
    return [
        "synth",
        "--mode",
        "cross_lingual",
        "--prompt-wav",
        "{prompt}",
        "--text",
        TEXT,
        "--out",
        "{out}",
        *extra,
    ]


CLI_CASES = [
    CliCase("empty_text", synth_args("--text", ""), "error: the text to speak is empty"),
    CliCase("whitespace_text", synth_args("--text", " \t "), "error: the text to speak is empty"),
    CliCase("huge_text", synth_args("--text", HUGE), f"error: the text has {HUGE_MSG}"),
    CliCase(
        "binary_text", synth_args("--text", "\x01\x02\x7f\xfe"), "error: the text contains control characters"
    ),
    CliCase("lone_surrogate_text", synth_args("--text", "Hi \udcff there"), "error: .*Unicode"),
    CliCase("unknown_mode", synth_args("--mode", "sing"), "argument --mode: invalid choice: 'sing'"),
    CliCase("speed_out_of_range", synth_args("--speed", "9"), r"error: speed must be within \[0.5, 2.0\]"),
    CliCase(
        "unknown_voice",
        ["synth", "--voice", "nobody", "--text", TEXT, "--out", "{out}"],
        "error: no saved voice",
    ),
    CliCase(
        "voice_dotdot",
        ["synth", "--voice", "../etc/passwd", "--text", TEXT, "--out", "{out}"],
        "error: invalid voice id",
    ),
    CliCase(
        "prompt_missing", synth_args("--prompt-wav", "/nonexistent/p.wav"), "error: audio file not found"
    ),
    CliCase("prompt_silent", synth_args("--prompt-wav", "{bad:silent}"), "error: the audio is silent"),
    CliCase(
        "prompt_not_audio",
        synth_args("--prompt-wav", "{bad:not_audio_text}"),
        "error: (not a readable audio file|the file has no audio stream)",
    ),
    CliCase("prompt_8khz", synth_args("--prompt-wav", "{bad:8khz}"), "error: .*8000 Hz"),
    CliCase("prompt_nan", synth_args("--prompt-wav", "{bad:nan_float}"), "error: the audio contains NaN"),
    CliCase(
        "prompt_huge_declared",
        synth_args("--prompt-wav", "{bad:huge_declared_flac}"),
        "error: .*the limit is 30 s",
    ),
    CliCase("prompt_clipped", synth_args("--prompt-wav", "{bad:clipped}"), OK),
    CliCase("unknown_out_format", synth_args("--out", "{dir}/out.xyz"), r"error: --out .*must end in \.wav"),
    CliCase(
        "out_dir_missing", synth_args("--out", "/nonexistent/dir/out.wav"), "error: --out .*does not exist"
    ),
    CliCase(
        "voice_name_dotdot",
        ["voices", "add", "--name", "../../etc/passwd", "--prompt-wav", "{prompt}", "--prompt-text", "Hi."],
        OK,
    ),
    CliCase(
        "voice_name_nul",
        ["voices", "add", "--name", "bad\x00name", "--prompt-wav", "{prompt}", "--prompt-text", "Hi."],
        "error: voice name contains control",
    ),
    CliCase(
        "voice_name_very_long",
        ["voices", "add", "--name", "n" * 500, "--prompt-wav", "{prompt}", "--prompt-text", "Hi."],
        "error: voice name is 500 characters",
    ),
    CliCase("voice_rm_dotdot", ["voices", "rm", "../voices"], "error: invalid voice id"),
]


def fill(args: list[str], prompt: Path, bad_dir: Path, out_dir: Path) -> list[str]:
    def one(arg: str) -> str:
        if arg.startswith("{bad:"):
            return str(write_bad(bad_dir, arg[5:-1]))
        return arg.format(prompt=prompt, out=out_dir / "out.wav", dir=out_dir)

    return [one(a) for a in args]


@pytest.mark.parametrize("case", params(CLI_CASES))
def test_cli_bad_inputs(engine, prompt, bad_dir, tmp_path, monkeypatch, capsys, case: CliCase):
    monkeypatch.setattr(cli, "_engine", lambda args: Bounded(engine))  # one engine, not a load per call
    try:
        rc = cli.main(fill(case.args, prompt, bad_dir, tmp_path))
    except SystemExit as exc:  # argparse refusals exit(2) with their usage message
        rc = exc.code
    err = capsys.readouterr().err
    if case.match == OK:
        assert rc == 0, err
    else:
        assert rc == 2 and re.search(case.match, err), err
        assert "Traceback" not in err
    assert asyncio.run(wait_idle(engine)), idle_state(engine)
    good = tmp_path / "good.wav"
    assert cli.main(fill(synth_args("--out", str(good)), prompt, bad_dir, tmp_path)) == 0
    assert json.loads(capsys.readouterr().out)["audio_s"] > 0
    check_pcm(sf.read(good, dtype="float32")[0])


async def test_assert_serves_fails_on_a_wedged_engine(engine, prompt):
    """The suite's own check can fail: a held admission slot is seen as not idle."""
    await engine.admission.acquire()
    try:
        assert not await wait_idle(engine, timeout_s=0.1)
    finally:
        engine.admission.release()
    await assert_serves(engine, prompt)
