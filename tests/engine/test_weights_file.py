"""engine.weights_file: a converted safetensors file read chunk by chunk onto a device, tensor for tensor what
safetensors itself reads, each in a storage of its own; a broken file is a ModelError naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ModelError
from engine.weights_file import read_onto


def mixed() -> dict[str, torch.Tensor]:
    """Every shape a state dict has (matrices, vectors, a scalar, an empty tensor) and the dtypes a
    conversion may hold, with sizes that are not multiples of the chunk."""
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 13, generator=g),
        "a.bias": torch.randn(13, generator=g).to(torch.bfloat16),
        "scale": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "steps": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(3, 3, generator=g).half(),
    }


@pytest.fixture
def weights_path(tmp_path) -> Path:
    path = tmp_path / "w.safetensors"
    save_file(mixed(), str(path))
    return path


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_every_tensor_is_the_files_whatever_the_chunk(weights_path, chunk):
    """Chunks of 7 bytes split every tensor across reads; one of 1 MiB holds the file whole."""
    want = load_file(str(weights_path))
    got = read_onto(weights_path, torch.device("cpu"), chunk_bytes=chunk)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name], tensor), name


def test_each_tensor_has_a_storage_of_its_own(weights_path):
    """As module.to(device) made them: compiled programs' caches key on their inputs' storage offsets."""
    got = read_onto(weights_path, torch.device("cpu"), chunk_bytes=16)
    sized = [t for t in got.values() if t.numel()]
    assert all(t.storage_offset() == 0 for t in sized)
    assert len({t.untyped_storage().data_ptr() for t in sized}) == len(sized)


def write_raw(path: Path, header: object, data: bytes, length: int | None = None) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + data)
    return path


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("truncated", "ends at byte 16 of 12"),
        ("header-length", "a header of"),
        ("not-json", "its header"),
        ("dtype", "'F8_E4M3' is not one this loader reads"),
        ("offsets", "bytes [0, 8)"),
        ("past-the-end", "ends at byte 16"),
    ],
)
def test_a_broken_file_is_a_model_error_that_names_it(tmp_path, case, why):
    entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    path = tmp_path / f"{case}.safetensors"
    if case == "truncated":
        write_raw(path, {"w": entry}, bytes(12))
    elif case == "header-length":
        write_raw(path, {"w": entry}, bytes(16), length=1 << 40)
    elif case == "not-json":
        path.write_bytes((5).to_bytes(8, "little") + b"{oops" + bytes(16))
    elif case == "dtype":
        write_raw(path, {"w": entry | {"dtype": "F8_E4M3"}}, bytes(16))
    elif case == "offsets":
        write_raw(path, {"w": entry | {"data_offsets": [0, 8]}}, bytes(16))
    else:
        write_raw(path, {"w": entry}, bytes(8))
    with pytest.raises(ModelError, match="delete it") as err:
        read_onto(path, torch.device("cpu"), chunk_bytes=8)
    assert str(path) in str(err.value) and why in str(err.value)


def test_a_file_cut_short_while_it_is_read_is_a_model_error(tmp_path):
    """The header is checked against the file's size first; a file that shrinks between that and the read
    (another process rewriting it) still fails, not half-filled."""
    import io

    from engine.weights_file import _read_exact

    with pytest.raises(ModelError, match="ends 2 bytes early"):
        _read_exact(io.BytesIO(b"abc"), memoryview(bytearray(5)), tmp_path / "w.safetensors")


def test_a_missing_file_is_a_model_error(tmp_path):
    with pytest.raises(ModelError, match="cannot read the converted weights"):
        read_onto(tmp_path / "gone.safetensors", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_every_tensor_is_the_files_through_the_page_locked_buffer(weights_path):
    want = load_file(str(weights_path))
    got = read_onto(weights_path, torch.device("cuda"), chunk_bytes=7)
    for name, tensor in want.items():
        assert got[name].is_cuda and torch.equal(got[name].cpu(), tensor), name
