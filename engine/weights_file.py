"""A converted weights file (safetensors, the cache root's ``weights/``) read straight onto an accelerator.

Why: memory-mapped, the full-size v3's files took 10-15 s of a warm start's path to ready on an H100
(``engine.checkpoint``'s log: "read" 4.7-7.2 s, "to cuda" 4.2-8.5 s for ~3.3 GB): every tensor's pages fault
in from the page cache one by one as it is copied, and each copy goes through the driver's staging of
pageable memory. Here the LM's and the flow's files are each read in large sequential chunks into one
page-locked buffer, and each tensor's bytes go from there into a device tensor of its own (as
``module.to(device)`` would have made it: separate storages, so compiled programs' caches see the same
inputs as before).

The format (safetensors' own, little-endian): 8 bytes of header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data, the
offsets counted from its start.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from io import BytesIO, RawIOBase
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine import device as devices
from engine.errors import ModelError

CHUNK_BYTES = 64 * 2**20  # the page-locked buffer the file passes through (64 MiB: ~10 ms of a PCIe copy)
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own bound on the JSON header
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: its bytes are [start, end) of the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    def __post_init__(self) -> None:
        size = math.prod(self.shape) * self.dtype.itemsize
        if not 0 <= self.start <= self.end or self.end - self.start != size:
            where = f"bytes [{self.start}, {self.end})"
            raise ValueError(f"{self.name}: {where} for {self.dtype} {list(self.shape)} ({size} B)")


def read_onto(path: Path, device: torch.device, chunk_bytes: int = CHUNK_BYTES) -> dict[str, torch.Tensor]:
    """Every tensor of ``path`` on ``device``, each in a storage of its own; a file that is not a whole
    safetensors file fails with a ``ModelError`` that names it."""
    try:
        with open(path, "rb", buffering=0) as f:
            entries, size = read_header(f, path)
            out = {e.name: torch.empty(e.shape, dtype=e.dtype, device=device) for e in entries}
            stage = devices.staging_bytes(min(chunk_bytes, max(size, 1)), device)
            _fill(f, path, entries, out, size, stage)
    except OSError as err:
        why = f"{err} (delete it to convert again)"
        raise ModelError(f"cannot read the converted weights {path}: {why}") from err
    return out


def read_header(f: RawIOBase, path: Path) -> tuple[list[Entry], int]:
    """The entries in the order of their bytes, and the data section's size; ``f`` is left at the data."""
    head = f.read(8)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    total = path.stat().st_size
    if not 0 < length <= min(MAX_HEADER_BYTES, total - 8):
        raise _broken(path, f"a header of {length} bytes in a file of {total}")
    try:
        header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        entries = [_entry(name, spec) for name, spec in header.items()]
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise _broken(path, f"its header: {err}") from err
    size = total - 8 - length
    entries.sort(key=lambda e: e.start)
    if entries and entries[-1].end > size:
        raise _broken(path, f"{entries[-1].name} ends at byte {entries[-1].end} of {size}")
    return entries, size


def _entry(name: str, spec: dict[str, Any]) -> Entry:
    dtype = spec["dtype"]
    if dtype not in DTYPES:
        raise ValueError(f"{name}: dtype {dtype!r} is not one this loader reads")
    begin, end = (int(n) for n in spec["data_offsets"])
    return Entry(name, DTYPES[dtype], tuple(int(n) for n in spec["shape"]), begin, end)


def _fill(
    f: RawIOBase, path: Path, entries: list[Entry], out: dict[str, Tensor], size: int, stage: Tensor
) -> None:
    """The data section through ``stage`` [chunk] uint8, a chunk at a time: each tensor gets the bytes of
    it that the chunk holds (blocking copies, so the buffer is free again when the chunk is done)."""
    room = memoryview(stage.numpy().data)
    for lo in range(0, size, stage.numel()):
        hi = min(lo + stage.numel(), size)
        _read_exact(f, room[: hi - lo], path)
        for e in entries:  # ~1,000 entries x ~50 chunks of comparisons: nothing beside the copies
            if e.start < hi and e.end > lo:
                a, b = max(e.start, lo), min(e.end, hi)
                _bytes_of(out[e.name])[a - e.start : b - e.start].copy_(stage[a - lo : b - lo])


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as flat uint8 (for any dtype: bool included)."""
    return tensor.reshape(-1).view(torch.uint8)


def _read_exact(f: RawIOBase | BytesIO, into: memoryview, path: Path) -> None:
    done = 0
    while done < len(into):
        n = f.readinto(into[done:])
        if not n:
            raise _broken(path, f"it ends {len(into) - done} bytes early")
        done += n


def _broken(path: Path, what: str) -> ModelError:
    return ModelError(f"the converted weights {path} are not a whole safetensors file ({what}): delete it")
