"""A small fake of ``engine.serving.engine.TTSEngine`` for UI/API control-logic tests.

It has the same public surface as the real engine (docs/engine-api.md): ``stream``, ``synthesize``,
``abort``, ``stats``, voices, ``info``. Audio is a 220 Hz sine, produced in ``chunk_s`` pieces with
``delay_s`` between them so cancellation and streaming can be observed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.asr import Transcript
from engine.errors import Conflict, Forbidden, InvalidInput, NotFound
from engine.request import AudioChunk, Mode, SynthesisRequest
from engine.serving.metrics import ServerStats, Stopwatch


@dataclass(frozen=True)
class FakeVoice:
    id: str
    name: str
    prompt_text: str
    duration_s: float = 3.0
    created_at: float = field(default_factory=time.time)
    public: bool = True
    example: bool = False
    consent: str = ""
    wav: str = ""  # the prompt it was saved from (``voice_preview``)


class FakeEngine:
    sample_rate = 24000
    family = "cosyvoice3"
    model_name = "fake"

    def __init__(self, n_chunks: int = 4, chunk_s: float = 0.2, delay_s: float = 0.01):
        self.n_chunks, self.chunk_s, self.delay_s = n_chunks, chunk_s, delay_s
        self.active: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []
        self.completed = 0
        self.voices: dict[tuple[str | None, str], FakeVoice] = {}  # (owner, id); owner None = public
        self.asr_model: str | None = "fake-whisper"
        self.transcripts: list[str] = []  # the language each transcribe() call was given
        self.ready = True
        self.healthy = True

    def instruct_presets(self) -> list[str]:
        return ["用广东话表达。", "请用尽可能快地语速说一句话。"]

    def check(self, req: SynthesisRequest) -> None:
        if req.mode != Mode.VC and not req.text.strip():
            raise InvalidInput("text is empty", field="text")
        if req.voice_id is not None and self._find(req.voice_id, req.voice_owner) is None:
            raise NotFound(f"no saved voice {req.voice_id!r}", field="voice_id")
        if (
            req.mode != Mode.VC
            and req.voice_id is None
            and req.prompt_wav is None
            and req.prompt_audio is None
        ):
            raise InvalidInput(
                "a prompt voice is needed: upload or record 3-30 s of speech, or pick a saved voice",
                field="voice_id",
            )

    async def stream(self, req: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        self.check(req)
        watch = Stopwatch(req.request_id, req.seed or 0)
        watch.started()
        watch.mark("frontend_done")
        self.active[req.request_id] = cancel = asyncio.Event()
        n = int(self.chunk_s * self.sample_rate)
        try:
            for i in range(self.n_chunks):
                watch.mark("first_chunk_ready")
                watch.mark("first_chunk_started")
                await asyncio.sleep(self.delay_s)
                if cancel.is_set():
                    return
                t = (np.arange(n) + i * n) / self.sample_rate
                pcm = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
                watch.add_text_tokens(len(req.text.encode()) if i == 0 else 0)  # one token a byte
                watch.add_tokens(int(self.chunk_s * 25))
                watch.add_audio(self.chunk_s)
                last = i == self.n_chunks - 1
                yield AudioChunk(pcm, self.sample_rate, i, last, watch.snapshot(done=last))
            self.completed += 1
        finally:
            self.active.pop(req.request_id, None)

    async def synthesize(self, req: SynthesisRequest) -> tuple[np.ndarray, AudioChunk]:
        chunks = [c async for c in self.stream(req)]
        return np.concatenate([c.pcm for c in chunks]), chunks[-1]

    def abort(self, request_id: str) -> bool:
        event = self.active.get(request_id)
        if event is None:
            return False
        event.set()
        self.aborted.append(request_id)
        return True

    def stats(self) -> ServerStats:
        return ServerStats(active_streams=len(self.active), completed=self.completed)

    def _find(self, voice_id: str, owner: str | None) -> FakeVoice | None:
        return self.voices.get((owner, voice_id)) or self.voices.get((None, voice_id))

    def add_voice(
        self, name: str, prompt_wav: str, prompt_text: str, owner: str | None = None, consent: str = ""
    ) -> FakeVoice:
        for seen in self.list_voices(owner):  # names are unique among what the owner sees, as the library's
            if seen.name.casefold() == name.casefold():
                raise Conflict(f"a voice is already named {seen.name!r} (id {seen.id!r})", field="name")
        voice_id = name.lower()
        while self._find(voice_id, owner) is not None:  # the real library's -2, -3 ... suffixes
            voice_id += "-2"
        voice = FakeVoice(voice_id, name, prompt_text, public=owner is None, consent=consent, wav=prompt_wav)
        self.voices[(owner, voice.id)] = voice
        return voice

    def list_voices(self, owner: str | None = None) -> list[FakeVoice]:
        mine = [v for (o, _), v in self.voices.items() if o is None or (owner is not None and o == owner)]
        return sorted(mine, key=lambda v: (v.name.casefold(), v.public, v.id))  # as the real library

    def delete_voice(self, voice_id: str, owner: str | None = None) -> None:
        if (owner, voice_id) in self.voices:
            del self.voices[(owner, voice_id)]
        elif (None, voice_id) in self.voices:
            raise Forbidden(
                f"voice {voice_id!r} is public: only the operator can delete it", field="voice_id"
            )
        else:
            raise NotFound(f"no saved voice {voice_id!r}", field="voice_id")

    def voice_preview(self, voice_id: str, owner: str | None = None) -> Path | None:
        """The saved voice's prompt file, the example's wav; NotFound as ``delete_voice``."""
        for example in self.example_voices():
            if getattr(example, "id", None) == voice_id:
                return Path(example.wav)  # type: ignore[attr-defined]
        voice = self._find(voice_id, owner)
        if voice is None:
            raise NotFound(f"no saved voice {voice_id!r}", field="voice_id")
        return Path(voice.wav) if voice.wav else None

    def example_voices(self) -> list[object]:
        return []

    async def transcribe(self, audio: object, language: str | None = None) -> Transcript:
        if self.asr_model is None:
            raise InvalidInput("transcription is off on this server (--asr-model none): type the transcript")
        self.transcripts.append(language or "auto")
        return Transcript("fake transcript", "en" if language in (None, "auto") else language, 3.0)


# A stand-in ``nvidia-cuda-mps-control``: ``-d`` "starts the daemon" (its control file in the pipe directory;
# FAIL_START: fail with that message instead; SILENT_DAEMON: start one that never answers; HOLD_OUTPUT=S:
# leave a child holding its stdout and stderr for S seconds, as a daemon may), the front end
# answers while the control file exists and logs every command to the log directory's calls.log;
# ``get_server_list`` prints the pipe directory's ``server`` file (written by a test: a client has
# connected); ``quit`` removes the control file.
FAKE_MPS_CONTROL = """#!/usr/bin/env bash
log="$CUDA_MPS_LOG_DIRECTORY/calls.log" control="$CUDA_MPS_PIPE_DIRECTORY/control"
server="$CUDA_MPS_PIPE_DIRECTORY/server"
if [ "${1:-}" = -d ]; then
  [ -z "${FAIL_START:-}" ] || { echo "$FAIL_START" >&2; exit 1; }
  echo "-d" >> "$log"; [ -n "${SILENT_DAEMON:-}" ] || touch "$control"
  [ -z "${HOLD_OUTPUT:-}" ] || (sleep "$HOLD_OUTPUT") &  # a daemon that keeps the output it was given
  exit 0
fi
[ -e "$control" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
while read -r cmd; do
  echo "$cmd" >> "$log"
  case "$cmd" in
    get_server_list) if [ -e "$server" ]; then cat "$server"; fi ;;
    quit) rm -f "$control" ;;
  esac
done
"""


def fake_mps_control(bin_dir: Path) -> Path:
    """Write the stand-in ``nvidia-cuda-mps-control`` into ``bin_dir`` (put it first on PATH)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "nvidia-cuda-mps-control"
    exe.write_text(FAKE_MPS_CONTROL)
    exe.chmod(0o755)
    return exe
