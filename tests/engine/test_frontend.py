"""engine/frontend.py with the ONNX stand-ins of fixtures/onnx (same signatures as the released files)."""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from engine import audio
from engine.errors import InvalidInput, ModelError, TooLarge
from engine.frontend import Frontend, PromptFeatures
from tests.conftest import WAIT_S, fixture_file, fixture_root

ROOT = fixture_root()
ONNX = ROOT / "onnx" if ROOT else None
FAMILIES = {"cosyvoice2": "v2", "cosyvoice3": "v3"}
STANDINS = ["campplus_standin.onnx", *(f"speech_tokenizer_{v}_standin.onnx" for v in FAMILIES.values())]
pytestmark = pytest.mark.skipif(
    ONNX is None or not all((ONNX / name).is_file() for name in STANDINS),
    reason=f"no fixture root with onnx/{{{','.join(STANDINS)}}} (COSYSTREAM_FIXTURES or ../shared/fixtures)",
)


def make_frontend(family: str = "cosyvoice3", **kwargs) -> Frontend:
    assert ONNX is not None
    tokenizer = ONNX / f"speech_tokenizer_{FAMILIES[family]}_standin.onnx"
    return Frontend(ONNX / "campplus_standin.onnx", tokenizer, family, "cpu", **kwargs)


def speechy(seconds: float, sr: int = 24000, seed: int = 0) -> np.ndarray:
    """Noise with a random 100 ms envelope: not silent, and varied enough that the stand-in emits many ids."""
    rng = np.random.default_rng(seed)
    n, segment = round(sr * seconds), sr // 10
    envelope = np.repeat(rng.uniform(0.0, 1.0, n // segment + 1) ** 4, segment)[:n]
    return (0.5 * rng.standard_normal(n) * envelope + 1e-3 * rng.standard_normal(n)).astype(np.float32)


class CountingSession:
    """Wraps an onnxruntime session to count runs (cache tests)."""

    def __init__(self, inner):
        self.inner, self.runs = inner, 0

    def get_inputs(self):
        return self.inner.get_inputs()

    def run(self, *args):
        self.runs += 1
        return self.inner.run(*args)


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_positional_calls_reproduce_standin_io(family):
    ref = np.load(fixture_file("onnx", "standin_io.npz"))
    frontend = make_frontend(family)
    tokens = frontend._run_tokenizer(ref["tokenizer_in_feats"][0])
    np.testing.assert_array_equal(tokens, ref[f"tokenizer_{FAMILIES[family]}_out"].reshape(-1))
    assert tokens.dtype == np.int32
    embedding = frontend._run_campplus(ref["campplus_in"][0])
    np.testing.assert_allclose(embedding, ref["campplus_out"].reshape(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_extract_untrimmed_is_each_feature_of_the_right_signal(family):
    frontend = make_frontend(family)
    x24 = speechy(2.05)
    features = frontend.extract(x24, trim=False)
    wav16 = audio.resample(x24, 24000, 16000)
    mel16 = audio.whisper_log_mel(wav16)
    np.testing.assert_array_equal(features.speech_tokens, frontend._run_tokenizer(mel16))
    assert len(features.speech_tokens) == -(-mel16.shape[1] // 4)  # stand-in: ceil(T / 4)
    assert len(np.unique(features.speech_tokens)) > 3  # so the equality checks mean something
    np.testing.assert_allclose(
        features.speaker_embedding, frontend._run_campplus(audio.kaldi_fbank(wav16)), rtol=1e-6
    )
    fmax = 8000.0 if family == "cosyvoice2" else None
    np.testing.assert_array_equal(features.prompt_mel, audio.prompt_mel(x24, fmax))
    assert features.prompt_mel.shape == (len(x24) // 480, 80)
    assert features.num_samples == len(x24) and features.duration_s == pytest.approx(2.05)
    assert features.family == family and not features.trimmed


def test_trim_aligns_two_mel_frames_per_token():
    features = make_frontend().extract(speechy(2.05))
    untrimmed = make_frontend().extract(speechy(2.05), trim=False)
    n = min(len(untrimmed.prompt_mel) // 2, len(untrimmed.speech_tokens))
    assert features.trimmed and len(features.speech_tokens) == n and len(features.prompt_mel) == 2 * n
    np.testing.assert_array_equal(features.speech_tokens, untrimmed.speech_tokens[:n])
    np.testing.assert_array_equal(features.prompt_mel, untrimmed.prompt_mel[: 2 * n])
    assert features.content_hash == untrimmed.content_hash


def test_features_are_read_only_and_validated():
    features = make_frontend().extract(speechy(1.0))
    with pytest.raises(ValueError):
        features.prompt_mel[0, 0] = 1.0
    with pytest.raises(ValueError, match="2 x tokens"):
        PromptFeatures(np.zeros(3), np.zeros(192), np.zeros((5, 80)), 2400, "h", "cosyvoice3", True)
    with pytest.raises(ValueError, match="shapes"):
        PromptFeatures(np.zeros(3), np.zeros(100), np.zeros((6, 80)), 2400, "h", "cosyvoice3", True)


def test_input_forms_agree():
    frontend = make_frontend()
    x48 = speechy(1.5, 48000)
    wav = audio.to_wav_bytes(x48, 48000)
    from_bytes = frontend.extract(wav)
    pcm = audio.read_audio(wav)
    assert frontend.extract(pcm).content_hash == from_bytes.content_hash
    assert frontend.extract((pcm.samples, 48000)).content_hash == from_bytes.content_hash
    int16 = np.round(pcm.samples * 32768).astype(np.int16)
    gradio = frontend.extract((48000, int16))
    np.testing.assert_array_equal(gradio.speech_tokens, from_bytes.speech_tokens)


def test_cache_hits_and_lru_bound():
    frontend = make_frontend(cache_size=2)
    counter = CountingSession(frontend._tokenizer)
    frontend._tokenizer = counter
    a, b, c = speechy(1.0, seed=1), speechy(1.0, seed=2), speechy(1.0, seed=3)
    first = frontend.extract(a, trim=False)
    assert frontend.extract(a, trim=False) is first and counter.runs == 1
    frontend.extract(b)
    frontend.extract(c)
    assert frontend.cache_info() == (2, 2)
    frontend.extract(a)  # evicted: computed again
    assert counter.runs == 4
    frontend.extract(c)
    assert counter.runs == 4


def test_different_audio_different_hash():
    frontend = make_frontend()
    assert (
        frontend.extract(speechy(1.0, seed=1)).content_hash
        != frontend.extract(speechy(1.0, seed=2)).content_hash
    )


def test_thread_safe_concurrent_extraction():
    frontend = make_frontend(cache_size=4)
    clips = [speechy(1.0 + 0.1 * i, seed=i) for i in range(6)]
    expected = [make_frontend().extract(x) for x in clips]
    barrier = threading.Barrier(4)

    def work(i: int) -> PromptFeatures:
        if i < 4:
            barrier.wait()
        return frontend.extract(clips[i % 6])

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(12)))
    for i, got in enumerate(results):
        np.testing.assert_array_equal(got.speech_tokens, expected[i % 6].speech_tokens)
        np.testing.assert_array_equal(got.prompt_mel, expected[i % 6].prompt_mel)
    assert frontend.cache_info()[0] <= 4


def test_one_prompt_arriving_many_times_at_once_is_computed_once(monkeypatch):
    """Requests that bring the same new prompt together wait for the first one's features instead of each
    computing them (a wave of visitors with one example voice)."""
    import engine.frontend as frontend_module

    frontend = make_frontend()
    computing, release, hashed = threading.Event(), threading.Event(), threading.Semaphore(0)
    real_compute, real_hash, runs = frontend._compute, frontend_module._content_hash, []

    def slow_compute(*args):
        runs.append(1)
        computing.set()
        release.wait(timeout=WAIT_S)
        return real_compute(*args)

    def counted_hash(*args):
        hashed.release()
        return real_hash(*args)

    monkeypatch.setattr(frontend, "_compute", slow_compute)
    monkeypatch.setattr(frontend_module, "_content_hash", counted_hash)
    clip = speechy(1.0, seed=5)
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(frontend.extract, clip)
        assert computing.wait(timeout=WAIT_S)
        others = [pool.submit(frontend.extract, clip) for _ in range(2)]
        for _ in range(3):  # the first request's hash and both others': they are past it
            assert hashed.acquire(timeout=WAIT_S)
        release.set()
        results = [first.result(), *(f.result() for f in others)]
    assert len(runs) == 1
    assert all(r.content_hash == results[0].content_hash for r in results)
    assert frontend.cache_info()[0] == 1


def test_a_failed_computation_fails_its_waiters_and_leaves_nothing_behind(monkeypatch):
    frontend = make_frontend()

    def broken(*args):
        raise RuntimeError("onnx failed")

    monkeypatch.setattr(frontend, "_compute", broken)
    with pytest.raises(RuntimeError, match="onnx"):
        frontend.extract(speechy(1.0, seed=6))
    assert frontend._running == {} and frontend.cache_info()[0] == 0


def test_vc_source_tokens():
    frontend = make_frontend()
    x = speechy(1.2)
    tokens = frontend.speech_tokens(x)
    np.testing.assert_array_equal(tokens, frontend.extract(x, trim=False).speech_tokens)


def test_prompt_over_30_seconds_is_refused():
    frontend = make_frontend(limits=audio.AudioLimits(max_seconds=60.0))
    with pytest.raises(TooLarge, match="30 s"):
        frontend.extract(np.full(24000 * 31, 0.1, np.float32))
    with pytest.raises(TooLarge):
        make_frontend().speech_tokens(np.full(24000 * 31, 0.1, np.float32))


def test_bad_audio_is_invalid_input():
    with pytest.raises(InvalidInput, match="silent"):
        make_frontend().extract(np.zeros(24000, np.float32))


def test_model_files_checked(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        Frontend(tmp_path / "campplus.onnx", tmp_path / "t.onnx", "cosyvoice3")
    (tmp_path / "broken.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(ModelError, match="cannot load"):
        Frontend(ONNX / "campplus_standin.onnx", tmp_path / "broken.onnx", "cosyvoice3")
    with pytest.raises(ModelError, match="2 expected"):  # campplus (1 input) given as the tokenizer
        Frontend(ONNX / "campplus_standin.onnx", ONNX / "campplus_standin.onnx", "cosyvoice3")
    with pytest.raises(ValueError, match="family"):
        Frontend(ONNX / "campplus_standin.onnx", ONNX / "speech_tokenizer_v3_standin.onnx", "cosyvoice1")


def test_from_model_dir(tmp_path):
    from engine import hub

    for name in hub.required_files("cosyvoice2"):
        path = Path(tmp_path / name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    shutil.copy(ONNX / "campplus_standin.onnx", tmp_path / "campplus.onnx")
    shutil.copy(ONNX / "speech_tokenizer_v2_standin.onnx", tmp_path / "speech_tokenizer_v2.onnx")
    frontend = Frontend.from_model_dir(hub.validate_model_dir(tmp_path))
    assert frontend.family == "cosyvoice2"
    assert frontend.extract(speechy(1.0)).family == "cosyvoice2"
