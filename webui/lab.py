"""The prompt lab's logic, free of HTTP and Gradio: a take's settings, the code that reproduces a take, and
a batch's lines.

A take is exactly one ``POST /v1/audio/speech`` body (``TakeSettings.body``): the lab renders it through the
API's own code path (``api.speech.speak``) with ``stream`` false, so the curl command and the Python snippet
(``code_for``) ask the server for the same computation and, with the same seed, get the same audio. The API
key is never written: the snippets read ``COSYSTREAM_API_KEY`` from the environment. The realtime WebSocket
snippet sends the same settings with the text as streamed input (bistream): its audio is another take.

A batch file is plain text (one line per take; blank lines skipped) or CSV with a ``text`` column and
optional ``voice`` and ``instruct`` columns (``parse_batch``); a line that cannot be rendered is reported
with its number and the others go on.
"""

from __future__ import annotations

import csv
import io
import json
import shlex
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine.request import Mode

MAX_TAKES = 8
MAX_BATCH_LINES = 200
MAX_BATCH_BYTES = 512 * 1024
FIELDS = ("input", "voice", "mode", "instructions", "seed", "speed", "language", "lexicon")
CSV_COLUMNS = ("text", "voice", "instruct")


@dataclass(frozen=True)
class TakeSettings:
    """What one take asked for; ``seed`` is the one the server reported, so the take can be made again."""

    input: str
    voice: str
    mode: str = "zero_shot"
    instructions: str = ""
    seed: int | None = None
    speed: float = 1.0
    language: str = "auto"
    lexicon: str | None = None

    def __post_init__(self) -> None:
        Mode(self.mode)  # ValueError names the mode
        if not 0.5 <= self.speed <= 2.0:
            raise ValueError(f"speed must be within [0.5, 2.0], got {self.speed}")

    @classmethod
    def of(cls, data: dict[str, Any]) -> TakeSettings:
        """From a JSON object with the API's field names (unknown keys refused: they would be dropped)."""
        unknown = set(data) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown take settings: {', '.join(sorted(unknown))}")
        seed = data.get("seed")
        return cls(
            input=str(data.get("input", "")),
            voice=str(data.get("voice", "")),
            mode=str(data.get("mode") or "zero_shot"),
            instructions=str(data.get("instructions") or ""),
            seed=None if seed in (None, "", -1) else int(seed),
            speed=float(data.get("speed", 1.0)),
            language=str(data.get("language") or "auto"),
            lexicon=str(data["lexicon"]) if data.get("lexicon") else None,
        )

    def body(self, model: str | None = None) -> dict[str, Any]:
        """The ``/v1/audio/speech`` JSON body: a whole wav (``stream`` false), only the fields that matter."""
        out: dict[str, Any] = {"model": model} if model else {}
        out |= {"input": self.input, "voice": self.voice, "response_format": "wav", "speed": self.speed}
        out |= {"stream": False, "mode": self.mode, "language": self.language}
        if self.mode == Mode.INSTRUCT:
            out["instructions"] = self.instructions
        if self.seed is not None:
            out["seed"] = self.seed
        if self.lexicon:
            out["lexicon"] = self.lexicon
        return out


@dataclass(frozen=True)
class Snippets:
    curl: str
    python: str
    realtime: str
    notes: list[str] = field(default_factory=list)


STANDARD = ("model", "voice", "input", "response_format", "speed")  # the openai client's own arguments


def code_for(
    settings: TakeSettings,
    base_url: str,
    model: str,
    private_voice: bool = False,
    private_lexicon: bool = False,
) -> Snippets:
    """curl, Python (the stock ``openai`` client) and a realtime WebSocket client for ``settings`` against
    ``base_url`` (the server as the browser reached it). The key comes from ``$COSYSTREAM_API_KEY``."""
    base = base_url.rstrip("/")
    body = settings.body(model)
    notes = []
    if private_voice:
        notes.append("private_voice")  # saved in this browser: an API key has its own voices
    if private_lexicon:
        notes.append("private_lexicon")  # the same: an API key has its own lexicons
    if settings.seed is None:
        notes.append("no_seed")
    return Snippets(_curl(base, body), _python(base, body), _realtime(base, settings), notes)


def _curl(base: str, body: dict[str, Any]) -> str:
    data = json.dumps(body, ensure_ascii=False)
    return (
        f"curl -sS {shlex.quote(base + '/v1/audio/speech')} \\\n"
        '  -H "Authorization: Bearer $COSYSTREAM_API_KEY" \\\n'
        '  -H "Content-Type: application/json" \\\n'
        f"  -d {shlex.quote(data)} \\\n"
        "  -o take.wav"
    )


def _py(value: Any) -> str:
    """A Python literal: JSON's strings, numbers and objects are Python's too, bar true/false/null."""
    return repr(value) if isinstance(value, bool) or value is None else json.dumps(value, ensure_ascii=False)


def _python(base: str, body: dict[str, Any]) -> str:
    extra = {k: v for k, v in body.items() if k not in STANDARD}
    args = "".join(f"    {k}={_py(body[k])},\n" for k in STANDARD if k in body)
    extra_lines = "".join(f"        {_py(k)}: {_py(v)},\n" for k, v in extra.items())
    return (
        "import os\n\n"
        "from openai import OpenAI\n\n"
        f"client = OpenAI(\n    base_url={_py(base + '/v1')},\n"
        '    api_key=os.environ.get("COSYSTREAM_API_KEY", "none"),\n)\n'
        "audio = client.audio.speech.create(\n"
        f"{args}"
        "    extra_body={\n"
        f"{extra_lines}"
        "    },\n"
        ")\n"
        'audio.write_to_file("take.wav")\n'
    )


def _realtime(base: str, settings: TakeSettings) -> str:
    ws = "ws" + base[4:] if base.startswith("http") else base
    session: dict[str, Any] = {"voice": settings.voice, "mode": settings.mode, "language": settings.language}
    session |= {"response_format": "wav"}
    if settings.mode == Mode.INSTRUCT:
        session["instructions"] = settings.instructions
    if settings.seed is not None:
        session["seed"] = settings.seed
    append = json.dumps({"type": "input_text_buffer.append", "text": settings.input}, ensure_ascii=False)
    return (
        "# the text streamed in as it is written (bistream): the same settings, another take\n"
        "import asyncio, base64, json, os\n\n"
        "import websockets\n\n\n"
        "async def main():\n"
        '    headers = {"Authorization": "Bearer " + os.environ.get("COSYSTREAM_API_KEY", "none")}\n'
        f"    url = {_py(ws + '/v1/audio/speech/realtime')}\n"
        "    async with websockets.connect(url, additional_headers=headers) as ws:\n"
        f'        await ws.send(json.dumps({{"type": "session.update", "session": {_py(session)}}}))\n'
        f"        await ws.send({_py(append)})\n"
        '        await ws.send(json.dumps({"type": "input_text_buffer.commit"}))\n'
        "        audio = b''\n"
        "        async for message in ws:\n"
        "            event = json.loads(message)\n"
        '            if event["type"] == "response.audio.delta":\n'
        '                audio += base64.b64decode(event["delta"])\n'
        '            elif event["type"] in ("response.done", "error"):\n'
        "                break\n"
        '    open("take.wav", "wb").write(audio)\n\n\n'
        "asyncio.run(main())\n"
    )


# ---------------------------------------------------------------------------------------------- batch


@dataclass(frozen=True)
class BatchLine:
    """One line of a batch file: its 1-based number in the file, the text and the per-line overrides."""

    number: int
    text: str
    voice: str = ""
    instruct: str = ""
    error: str = ""  # why it cannot be rendered ("" = fine)


class BatchError(ValueError):
    """The file as a whole is refused (too big, too many lines, no text column): nothing is rendered.
    ``too_large``: past a limit of the server (HTTP 413), else malformed (422)."""

    def __init__(self, message: str, too_large: bool = False):
        super().__init__(message)
        self.too_large = too_large


def parse_batch(name: str, data: bytes, max_chars: int, max_lines: int = MAX_BATCH_LINES) -> list[BatchLine]:
    """The lines of a ``.txt`` (one text per line) or ``.csv`` (a ``text`` column, optional ``voice`` and
    ``instruct``) file. A line over ``max_chars`` is kept with its error; the file past the limits raises."""
    if len(data) > MAX_BATCH_BYTES:
        raise BatchError(f"the file is {len(data)} bytes; the limit is {MAX_BATCH_BYTES}", too_large=True)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise BatchError(f"the file is not UTF-8 text ({err.reason} at byte {err.start})") from err
    lines = _csv_lines(text) if name.lower().endswith(".csv") else _text_lines(text)
    lines = [ln for ln in lines if ln.text.strip() or ln.error]
    if not lines:
        raise BatchError("the file has no line to render")
    if len(lines) > max_lines:
        message = f"the file has {len(lines)} lines; this server renders at most {max_lines} a batch"
        raise BatchError(message, too_large=True)
    return [_checked(ln, max_chars) for ln in lines]


def _text_lines(text: str) -> list[BatchLine]:
    return [BatchLine(i, line.strip()) for i, line in enumerate(text.splitlines(), start=1)]


def _csv_lines(text: str) -> list[BatchLine]:
    reader = csv.DictReader(io.StringIO(text))
    columns = [c.strip().lower() for c in reader.fieldnames or []]
    if "text" not in columns:
        raise BatchError(f"the CSV has no 'text' column (its columns: {', '.join(columns) or 'none'})")
    unknown = [c for c in columns if c not in CSV_COLUMNS]
    if unknown:
        raise BatchError(f"unknown CSV columns {', '.join(unknown)}; expected {', '.join(CSV_COLUMNS)}")
    reader.fieldnames = columns
    out = []
    for row in reader:
        extra = row.pop(None, None)  # type: ignore[call-overload]
        values = {k: (v or "").strip() for k, v in row.items()}
        line = BatchLine(
            reader.line_num, values.get("text", ""), values.get("voice", ""), values.get("instruct", "")
        )
        if extra:
            line = replace(line, error="the row has more cells than the header")
        elif not line.text and (line.voice or line.instruct):
            line = replace(line, error="the text is empty")
        out.append(line)
    return out


def _checked(line: BatchLine, max_chars: int) -> BatchLine:
    if line.error:
        return line
    if not line.text.strip():
        return replace(line, error="the text is empty")
    if len(line.text) > max_chars:
        return replace(line, error=f"the text has {len(line.text)} characters; the limit is {max_chars}")
    return line


def manifest_row(
    line: BatchLine, file: str, settings: TakeSettings, metrics: dict[str, Any]
) -> dict[str, Any]:
    """One manifest entry: the line, its wav (or error) and everything needed to render it again."""
    return {"line": line.number, "file": file, "error": line.error, **asdict(settings), **metrics}
