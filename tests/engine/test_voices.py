"""engine/voices.py: the saved-voice library on disk (atomic entries, safe names, damage, families)."""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf

from engine import voices as voices_mod
from engine.audio import Audio
from engine.errors import Conflict, Forbidden, InvalidInput, NotFound
from engine.frontend import PromptFeatures
from engine.voices import VoiceLibrary


def features(family: str = "cosyvoice3", n: int = 50, seed: int = 0) -> PromptFeatures:
    rng = np.random.default_rng(seed)
    return PromptFeatures(
        speech_tokens=rng.integers(0, 6561, n),
        speaker_embedding=rng.standard_normal(192),
        prompt_mel=rng.standard_normal((2 * n, 80)),
        num_samples=n * 960,
        content_hash=f"hash{seed}",
        family=family,
        trimmed=True,
    )


def tone(seconds: float = 1.0, sr: int = 24000) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 220 * np.arange(int(sr * seconds)) / sr)).astype(np.float32)


def test_add_get_round_trip(tmp_path):
    lib = VoiceLibrary(tmp_path, family="cosyvoice3")
    feats = features()
    voice = lib.add("Alice (calm)", feats, "You are a helpful assistant.<|endofprompt|>Hi.", preview=tone())
    assert voice.id == "alice-calm" and voice.name == "Alice (calm)" and voice.family == "cosyvoice3"
    assert voice.duration_s == pytest.approx(2.0) and voice.created_at > 0 and voice.compatible
    got_voice, got = lib.get("alice-calm")
    assert got_voice == voice
    np.testing.assert_array_equal(got.speech_tokens, feats.speech_tokens)
    np.testing.assert_array_equal(got.speaker_embedding, feats.speaker_embedding)
    np.testing.assert_array_equal(got.prompt_mel, feats.prompt_mel)
    assert (got.num_samples, got.content_hash, got.family, got.trimmed) == (
        4800 * 10,
        "hash0",
        "cosyvoice3",
        True,
    )
    assert sorted(os.listdir(tmp_path / "alice-calm")) == ["features.npz", "meta.json", "prompt.wav"]
    wav, sr = sf.read(lib.preview_path("alice-calm"))
    assert sr == 24000 and len(wav) == 24000


def wav_file_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    sf.write(buf, tone(), 24000, format="WAV")
    return buf.getvalue()


PREVIEWS = {
    "wav bytes": wav_file_bytes,
    "Audio": lambda: Audio(tone(), 24000),
    "(samples, rate)": lambda: (tone(0.5, 48000), 48000),
    "gradio (rate, int16)": lambda: (48000, np.full(100, 1000, np.int16)),
    "24 kHz array": lambda: tone(0.5),
}


@pytest.mark.parametrize("kind", sorted(PREVIEWS))
def test_preview_forms(tmp_path, kind):
    lib = VoiceLibrary(tmp_path)
    lib.add("v", features(), preview=PREVIEWS[kind]())
    info = sf.info(lib.preview_path("v"))
    assert info.format == "WAV" and info.subtype == "PCM_16" and info.frames > 0


def test_no_preview(tmp_path):
    lib = VoiceLibrary(tmp_path)
    lib.add("v", features())
    assert lib.preview_path("v") is None


def test_list_sorted_and_unique_ids(tmp_path):
    lib = VoiceLibrary(tmp_path)
    for name in ("bob", "Alice", "bob?", "Bob!", "张三", "李四"):
        lib.add(name, features())
    ids = [v.id for v in lib.list()]
    names = [v.name for v in lib.list()]
    assert names[:4] == ["Alice", "bob", "Bob!", "bob?"]
    assert {"alice", "bob", "bob-2", "bob-3"} <= set(ids) and len(set(ids)) == 6
    cjk = [v.id for v in lib.list() if v.name in ("张三", "李四")]
    assert all(i.startswith("voice-") for i in cjk) and cjk[0] != cjk[1]


def test_delete_and_not_found(tmp_path):
    lib = VoiceLibrary(tmp_path)
    lib.add("carol", features())
    lib.delete("carol")
    assert lib.list() == [] and not (tmp_path / "carol").exists()
    with pytest.raises(NotFound):
        lib.get("carol")
    with pytest.raises(NotFound):
        lib.delete("carol")


@pytest.mark.parametrize("name", ["", "   ", "a" * 65, "evil\x00name", "line\nbreak", "bell\x07"])
def test_bad_names_rejected(tmp_path, name):
    with pytest.raises(InvalidInput):
        VoiceLibrary(tmp_path).add(name, features())
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["../../etc/passwd", "/abs/path", "..", "a/../../b", "..\\..\\win"])
def test_path_like_names_stay_inside(tmp_path, name):
    root = tmp_path / "lib"
    lib = VoiceLibrary(root)
    voice = lib.add(name, features())
    assert voice.name == name and (root / voice.id).is_dir()
    assert "/" not in voice.id and "\\" not in voice.id and not voice.id.startswith(".")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lib"]
    assert [v.id for v in lib.list()] == [voice.id]


@pytest.mark.parametrize("bad_id", ["../etc", "/abs", "a/b", "", ".hidden", "UPPER", "x\x00"])
def test_bad_ids_rejected(tmp_path, bad_id):
    lib = VoiceLibrary(tmp_path)
    for call in (lib.get, lib.delete, lib.preview_path):
        with pytest.raises(InvalidInput, match="invalid voice id"):
            call(bad_id)


def test_damaged_entry_is_skipped_with_warning(tmp_path, caplog):
    lib = VoiceLibrary(tmp_path)
    lib.add("good", features())
    lib.add("bad", features())
    (tmp_path / "bad" / "meta.json").write_text("{not json")
    lib.add("nofeat", features())
    os.remove(tmp_path / "nofeat" / "features.npz")
    (tmp_path / "stray-dir").mkdir()
    (tmp_path / "note.txt").write_text("not a voice")
    with caplog.at_level(logging.WARNING, logger="engine.voices"):
        assert [v.id for v in lib.list()] == ["good"]
    assert "bad" in caplog.text and "nofeat" in caplog.text
    with pytest.raises(NotFound, match="damaged"):
        lib.get("bad")
    (tmp_path / "good" / "features.npz").write_bytes(b"garbage")
    with pytest.raises(NotFound, match="damaged"):
        lib.get("good")


def test_other_family_is_listed_but_flagged(tmp_path):
    VoiceLibrary(tmp_path, family="cosyvoice2").add("old", features("cosyvoice2"))
    lib = VoiceLibrary(tmp_path, family="cosyvoice3")
    lib.add("new", features("cosyvoice3"))
    flags = {v.id: v.compatible for v in lib.list()}
    assert flags == {"old": False, "new": True}
    with pytest.raises(InvalidInput, match="cosyvoice2"):
        lib.get("old")
    assert VoiceLibrary(tmp_path).get("old")[1].family == "cosyvoice2"  # family None: accept all


def test_family_must_match_features(tmp_path):
    with pytest.raises(InvalidInput, match="extracted for cosyvoice3"):
        VoiceLibrary(tmp_path).add("x", features("cosyvoice3"), family="cosyvoice2")


def test_crash_during_add_leaves_nothing(tmp_path, monkeypatch):
    lib = VoiceLibrary(tmp_path)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(voices_mod, "_features_bytes", crash)
    with pytest.raises(OSError, match="disk full"):
        lib.add("dave", features())
    assert os.listdir(tmp_path) == [] and lib.list() == []


def test_leftovers_of_a_crash_are_ignored_then_swept(tmp_path):
    lib = VoiceLibrary(tmp_path)
    lib.add("erin", features())
    half = tmp_path / ".tmp-abc123"
    half.mkdir()
    (half / "features.npz").write_bytes(b"partial")
    (tmp_path / ".trash-frank-1234").mkdir()
    assert [v.id for v in lib.list()] == ["erin"]
    VoiceLibrary(tmp_path)  # a restart
    assert sorted(os.listdir(tmp_path)) == ["erin"]


def test_entry_files_are_written_atomically(tmp_path, monkeypatch):
    """Every file goes through os.replace from a temporary name in the same directory."""
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        assert os.path.dirname(src) == os.path.dirname(dst)
        replaced.append(os.path.basename(dst))
        real_replace(src, dst)

    monkeypatch.setattr(voices_mod.os, "replace", spy)
    VoiceLibrary(tmp_path).add("gina", features(), preview=tone())
    assert sorted(replaced) == ["features.npz", "meta.json", "prompt.wav"]
    meta = json.loads((tmp_path / "gina" / "meta.json").read_text())
    assert meta["name"] == "gina" and meta["content_hash"] == "hash0"


def test_concurrent_adds_and_deletes(tmp_path):
    """Adds of names with one slug and deletes interleave safely: every add gets its own id."""
    lib = VoiceLibrary(tmp_path)
    for i in range(4):
        lib.add(f"keep {i}", features(seed=i))
    barrier = threading.Barrier(8)

    def add(i: int) -> str:
        barrier.wait()
        return lib.add("same name" + "!" * i, features(seed=i)).id  # one slug, distinct names

    def delete(i: int) -> None:
        barrier.wait()
        lib.delete(f"keep-{i}")

    with ThreadPoolExecutor(8) as pool:
        added = [pool.submit(add, i) for i in range(6)]
        deleted = [pool.submit(delete, i) for i in range(2)]
        ids = [f.result() for f in added]
        for f in deleted:
            f.result()
    assert len(set(ids)) == 6
    listed = {v.id for v in lib.list()}
    assert listed == set(ids) | {"keep-2", "keep-3"}
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_concurrent_adds_of_one_name_save_one_voice(tmp_path):
    lib = VoiceLibrary(tmp_path)
    barrier = threading.Barrier(6)

    def add(i: int) -> str:
        barrier.wait()
        return lib.add("same name", features(seed=i)).id

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(add, i) for i in range(6)]
    outcomes = [f.exception() or f.result() for f in futures]
    assert sum(isinstance(o, Conflict) for o in outcomes) == 5 and "same-name" in outcomes
    assert [v.id for v in lib.list()] == ["same-name"]


# ---- owners: a visitor's voices are private; public voices and examples are read-only to visitors


def test_owners_see_public_voices_and_only_their_own(tmp_path):
    lib = VoiceLibrary(tmp_path, family="cosyvoice3")
    lib.add("Shared", features(seed=1), "public text")
    lib.add("Alice", features(seed=2), "alice text", owner="browser-a")
    lib.add("Bob", features(seed=3), "bob text", owner="key-b")
    assert [(v.name, v.public) for v in lib.list("browser-a")] == [("Alice", False), ("Shared", True)]
    assert [v.name for v in lib.list("key-b")] == ["Bob", "Shared"]
    assert [v.name for v in lib.list()] == ["Shared"]
    assert lib.get("alice", "browser-a")[0].prompt_text == "alice text"
    with pytest.raises(NotFound):
        lib.get("alice", "key-b")  # another owner's voice is as good as absent
    with pytest.raises(NotFound):
        lib.get("alice")
    assert not any("browser-a" in str(p) for p in tmp_path.rglob("*"))  # the owner string is hashed


def test_only_the_owner_deletes_and_public_voices_are_the_operators(tmp_path):
    lib = VoiceLibrary(tmp_path, family="cosyvoice3")
    lib.add("Shared", features(seed=1), "t")
    lib.add("Alice", features(seed=2), "t", owner="a")
    with pytest.raises(NotFound):
        lib.delete("alice", "b")
    with pytest.raises(Forbidden):
        lib.delete("shared", "a")
    lib.delete("alice", "a")
    assert [v.name for v in lib.list("a")] == ["Shared"]
    lib.delete("shared")  # the operator (owner None) may
    assert lib.list("a") == []


def test_private_ids_never_shadow_public_ones(tmp_path):
    lib = VoiceLibrary(tmp_path, family="cosyvoice3")
    lib.add("Alice", features(seed=1), "public")
    with pytest.raises(Conflict, match="public voice is already named 'Alice'"):
        lib.add("ALICE", features(seed=2), "mine", owner="a")  # one name, one voice, as the owner sees them
    mine = lib.add("Alice!", features(seed=2), "mine", owner="a")
    assert mine.id == "alice-2" and lib.get("alice", "a")[0].prompt_text == "public"
    names = [(v.id, v.public) for v in lib.list("a")]
    assert names == [("alice", True), ("alice-2", False)]  # one slug, told apart by id and scope


def write_example(folder, stem: str, text: str, seconds: float = 4.0) -> None:
    sf.write(folder / f"{stem}.wav", tone(seconds, 16000), 16000)
    (folder / f"{stem}.txt").write_text(text + "\n", encoding="utf-8")


def test_examples_are_read_from_wav_and_txt_pairs(tmp_path, caplog):
    write_example(tmp_path, "zh-lan", "大家好")
    write_example(tmp_path, "narrator", "Hello.")
    sf.write(tmp_path / "orphan.wav", tone(4.0, 16000), 16000)  # no transcript: skipped
    (tmp_path / "blank.wav").write_bytes(b"")
    (tmp_path / "blank.txt").write_text("  \n")  # empty transcript: skipped with a warning
    with caplog.at_level(logging.WARNING):
        examples = voices_mod.load_examples(tmp_path)
    assert [(e.id, e.language, e.transcript) for e in examples] == [
        ("narrator", "auto", "Hello."),
        ("zh-lan", "zh", "大家好"),
    ]
    assert "orphan.wav" in caplog.text and "blank.wav" in caplog.text
    lan = examples[1].as_voice("cosyvoice3")  # the recording's real length and time
    assert (
        lan.duration_s == pytest.approx(4.0) and lan.created_at == (tmp_path / "zh-lan.wav").stat().st_mtime
    )


def test_examples_are_public_read_only_and_answer_to_openai_names(tmp_path):
    assets = tmp_path / "assets"
    assets.mkdir()
    write_example(assets, "en-amy", "Hello there.")
    lib = VoiceLibrary(tmp_path / "lib", "cosyvoice3", voices_mod.load_examples(assets))
    assert [(v.id, v.public, v.example) for v in lib.list("anyone")] == [("en-amy", True, True)]
    assert lib.example("en-amy", "anyone").transcript == "Hello there."
    assert lib.example("alloy").id == "en-amy" and lib.example("ALLOY").id == "en-amy"
    assert lib.example("nova") is None  # its example (zh-lan) is not in this folder
    with pytest.raises(Forbidden):
        lib.delete("en-amy")
    for stock in ("alloy", "ALLOY", "Nova"):  # reserved: a saved one would shadow the stock voice
        with pytest.raises(Conflict, match="stock voice name"):
            lib.add(stock, features(), "my own alloy")
    assert lib.example("alloy").id == "en-amy"
    with pytest.raises(Conflict, match="example voice"):
        lib.add("En-Amy", features(), "mine", owner="anyone")


def test_names_are_unique_per_owner_and_consent_is_kept(tmp_path):
    lib = VoiceLibrary(tmp_path, family="cosyvoice3")
    lib.add("Dora", features(seed=1), "t", owner="a", consent="cons_1234")
    lib.add("Dora", features(seed=2), "t", owner="b")  # another owner's namespace: free
    with pytest.raises(Conflict) as caught:
        lib.add("dora", features(seed=3), "t", owner="a")
    assert caught.value.field == "name" and "delete that voice first" in str(caught.value)
    (mine,) = lib.list("a")
    assert (mine.name, mine.consent) == ("Dora", "cons_1234") and lib.get(mine.id, "a")[
        0
    ].consent == "cons_1234"
    with pytest.raises(InvalidInput, match="consent"):
        lib.add("Eve", features(), "t", owner="a", consent="x" * 300)


def test_shipped_examples_cover_the_openai_names():
    examples = {e.id: e for e in voices_mod.load_examples()}
    assert {e.language for e in examples.values()} >= {"zh", "en", "ja", "ko", "yue"}
    assert set(voices_mod.OPENAI_VOICES.values()) <= set(examples)
    for e in examples.values():
        info = sf.info(e.wav)
        assert 16000 <= info.samplerate <= 24000 and 3.0 <= info.duration <= 10.0 and e.transcript
