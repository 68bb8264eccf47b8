"""Requests that cross hosts: audio named by a local path travels as its bytes.

The ingress gets uploads as files in its own temp dir (Gradio) that a replica on another host cannot read.
``pack`` reads those files; the replica's ``unpacked`` writes them into a private temp dir for the length of
the call and hands the engine a request naming those copies, so the engine decodes and checks them exactly
as it does a local upload (same limits, same messages).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.request import SynthesisRequest

PATH_FIELDS = ("prompt_wav", "source_wav")


@dataclass(frozen=True)
class ShippedFile:
    """The bytes of a file, and its name (the suffix tells PyAV the container)."""

    name: str
    data: bytes

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ShippedFile:
        return cls(Path(path).name, Path(path).read_bytes())

    def write(self, directory: Path) -> str:
        path = directory / (Path(self.name).name or "audio")  # a bare name: never a path outside the dir
        path.write_bytes(self.data)
        return str(path)


@dataclass(frozen=True)
class Parcel:
    """A request with its path fields emptied and their files carried alongside, by field name."""

    request: SynthesisRequest
    files: tuple[tuple[str, ShippedFile], ...] = ()


def pack(req: SynthesisRequest) -> Parcel:
    """Read every file the request names by path (the caller's host) into the parcel."""
    files = tuple((f, ShippedFile.read(p)) for f in PATH_FIELDS if (p := getattr(req, f)) is not None)
    if not files:
        return Parcel(req)
    return Parcel(dataclasses.replace(req, prompt_wav=None, source_wav=None), files)


@contextlib.contextmanager
def unpacked(parcel: Parcel) -> Iterator[SynthesisRequest]:
    """The request naming local copies of its files, removed when the block ends."""
    if not parcel.files:
        yield parcel.request
        return
    with tempfile.TemporaryDirectory(prefix="cosystream-parcel-") as tmp:
        paths = {field: shipped.write(Path(tmp) / field) for field, shipped in _with_dirs(parcel, tmp)}
        yield dataclasses.replace(
            parcel.request, prompt_wav=paths.get("prompt_wav"), source_wav=paths.get("source_wav")
        )


def _with_dirs(parcel: Parcel, tmp: str) -> Iterator[tuple[str, ShippedFile]]:
    for field, shipped in parcel.files:  # one sub-dir per field: two uploads may share a name
        (Path(tmp) / field).mkdir()
        yield field, shipped


@contextlib.contextmanager
def local_audio(audio: str | ShippedFile | object) -> Iterator[object]:
    """A voice upload as the engine takes it: a shipped file becomes a temp path; anything else as is."""
    if not isinstance(audio, ShippedFile):
        yield audio
        return
    with tempfile.TemporaryDirectory(prefix="cosystream-voice-") as tmp:
        yield audio.write(Path(tmp))


def ship_audio(audio: object) -> object:
    """The caller's side of ``local_audio``: a path becomes its bytes; decoded audio travels as it is."""
    return ShippedFile.read(audio) if isinstance(audio, str | os.PathLike) else audio
