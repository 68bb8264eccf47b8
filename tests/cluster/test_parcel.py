"""Uploads named by a path on the ingress's host travel as bytes and are files again on the replica."""

from __future__ import annotations

from pathlib import Path

from cluster.parcel import ShippedFile, local_audio, pack, ship_audio, unpacked
from engine.request import Mode, SynthesisRequest


def test_pack_carries_the_files_and_unpack_names_local_copies(tmp_path: Path) -> None:
    prompt, source = tmp_path / "a" / "x.wav", tmp_path / "b" / "x.wav"  # two uploads, one name
    for path, data in ((prompt, b"prompt"), (source, b"source")):
        path.parent.mkdir()
        path.write_bytes(data)
    req = SynthesisRequest(text="", mode=Mode.VC, prompt_wav=str(prompt), source_wav=str(source), seed=3)
    parcel = pack(req)
    assert parcel.request.prompt_wav is None and parcel.request.source_wav is None
    prompt.unlink()  # the replica must not need the ingress's files
    with unpacked(parcel) as local:
        assert Path(local.prompt_wav or "").read_bytes() == b"prompt"
        assert Path(local.source_wav or "").read_bytes() == b"source"
        assert (local.seed, local.request_id, local.mode) == (3, req.request_id, Mode.VC)
        copies = [Path(local.prompt_wav or ""), Path(local.source_wav or "")]
    assert not any(p.exists() for p in copies)  # removed after the call


def test_a_request_without_paths_travels_as_is() -> None:
    req = SynthesisRequest(text="hi", voice_id="alice")
    parcel = pack(req)
    assert parcel.files == () and parcel.request is req
    with unpacked(parcel) as local:
        assert local is req


def test_a_shipped_name_cannot_leave_its_directory(tmp_path: Path) -> None:
    written = ShippedFile("../../etc/evil.wav", b"x").write(tmp_path)
    assert Path(written).parent == tmp_path and Path(written).name == "evil.wav"


def test_voice_audio_ships_paths_and_passes_decoded_audio(tmp_path: Path) -> None:
    path = tmp_path / "v.flac"
    path.write_bytes(b"flac bytes")
    shipped = ship_audio(str(path))
    assert shipped == ShippedFile("v.flac", b"flac bytes")
    with local_audio(shipped) as local:
        assert str(local).endswith(".flac") and Path(str(local)).read_bytes() == b"flac bytes"
    assert not Path(str(local)).exists()
    decoded = ([0.0, 0.1], 16000)
    assert ship_audio(decoded) is decoded
    with local_audio(decoded) as same:
        assert same is decoded
