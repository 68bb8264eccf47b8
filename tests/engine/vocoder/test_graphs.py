"""v3's HiFT as CUDA graphs: the padded bucket call the graph records gives each row's exact audio.

On the CPU the capture is emulated (``Recorded`` runs the recorded function eagerly on the static
buffers), which checks the bucketing, padding and slicing; the real capture runs in the gpu test.
"""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_model
from engine.hub import validate_model_dir
from engine.vocoder.graphs import GraphedHiFT
from tests.engine.test_graph_cache import emulate_capture


@pytest.fixture(scope="module")
def hift(tmp_path_factory):
    from engine.demo.make_model import build_model_dir

    root = tmp_path_factory.mktemp("v3")
    return load_model(
        validate_model_dir(build_model_dir(root, "cosyvoice3", "tiny")), torch.device("cpu")
    ).hift


def mels(batch: int, frames: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 80, frames, generator=torch.Generator().manual_seed(seed))


def test_non_final_calls_equal_eager_from_one_padded_bucket_graph(hift, monkeypatch):
    made = emulate_capture(monkeypatch)
    graphed = GraphedHiFT(hift, frame_bucket=100)
    with torch.inference_mode():
        for batch, frames in ((3, 57), (1, 91), (4, 100)):  # all in bucket (4 or 1, 100)
            mel = mels(batch, frames)
            want_speech, want_source = hift.inference(mel, False)
            speech, source = graphed(mel, False)
            assert speech.shape == want_speech.shape and source.shape == want_source.shape
            torch.testing.assert_close(speech, want_speech, atol=1e-5, rtol=0)
            torch.testing.assert_close(source, want_source, atol=1e-5, rtol=0)
    assert made == [((4, 80, 100),), ((1, 80, 100),)]  # (4, 100) replayed the first graph


def test_final_and_overlong_calls_run_eager(hift, monkeypatch):
    made = emulate_capture(monkeypatch)
    graphed = GraphedHiFT(hift, frame_bucket=100, max_frames=200)
    with torch.inference_mode():
        for mel, finalize in ((mels(2, 60), True), (mels(1, 201), False)):
            want = hift.inference(mel, finalize)[0]
            torch.testing.assert_close(graphed(mel, finalize)[0], want, atol=0, rtol=0)
    assert made == []


def test_precapture_covers_every_bucket_largest_first(hift, monkeypatch):
    made = emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.vocoder.graphs.devices.empty_cache", lambda dev: None)
    graphed = GraphedHiFT(hift, frame_bucket=100, max_frames=200)
    assert graphed.precapture(3, 900, torch.device("cpu")) == 6  # batch 4, 2, 1 x frames 200, 100
    assert [shape[0] for shape in made] == [(4, 80, 200), (4, 80, 100), (2, 80, 200), (2, 80, 100),
                                            (1, 80, 200), (1, 80, 100)]  # fmt: skip
    with pytest.raises(ValueError, match="frame_bucket"):
        GraphedHiFT(hift, frame_bucket=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_vocoder_matches_eager_on_cuda(hift):
    """Real capture: STFT, the overlap-add iSTFT and the float64 f0 predictor all record; replays of one
    bucket with new values give each call's own audio (true fp32: TF32 convs pick shape-dependent kernels)."""
    import copy

    dev = torch.device("cuda")
    gpu = copy.deepcopy(hift).to(dev)
    graphed = GraphedHiFT(gpu, frame_bucket=100)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.inference_mode():
            first, second = mels(3, 57).to(dev), mels(4, 80, seed=1).to(dev)  # one bucket: (4, 100)
            a = graphed(first, False)[0]
            kept = a.clone()
            graphed(second, False)
            eager = gpu.inference(first, False)[0]
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    assert len(graphed.graphs) == 1
    torch.testing.assert_close(a, kept, atol=0, rtol=0)
    torch.testing.assert_close(a, eager, atol=1e-4, rtol=1e-4)


def test_after_precapture_an_uncaptured_bucket_runs_eager(hift, monkeypatch):
    made = emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.vocoder.graphs.devices.empty_cache", lambda dev: None)
    graphed = GraphedHiFT(hift, frame_bucket=100, max_frames=200)
    assert graphed.precapture(1, 100, torch.device("cpu")) == 1
    mel = mels(2, 150)  # batch 2, 200 frames: within max_frames, never captured
    with torch.inference_mode():
        want = hift.inference(mel, False)[0]
        torch.testing.assert_close(graphed(mel, False)[0], want, atol=0, rtol=0)
    assert made == [((1, 80, 100),)]


def test_before_its_bucket_is_captured_a_call_replays_the_widest_graph_exactly(hift, monkeypatch):
    """With the rest left to the background builder, the first graphs are the widest at batch 1 and at
    the largest batch, and a smaller non-final call replays the cheapest of them that holds it."""
    from tests.engine.test_graph_cache import Recorded

    made = emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.vocoder.graphs.devices.empty_cache", lambda dev: None)
    replayed: list[tuple[int, ...]] = []
    replay = Recorded.replay

    def counted(self, *values):
        replayed.append(tuple(self.inputs[0].shape))
        return replay(self, *values)

    monkeypatch.setattr(Recorded, "replay", counted)
    graphed = GraphedHiFT(hift, frame_bucket=100, max_frames=200)
    assert graphed.precapture(4, 200, torch.device("cpu"), lambda name, job: None) == 6
    assert sorted(m[0] for m in made) == [(1, 80, 200), (4, 80, 200)]
    with torch.inference_mode():
        for batch, frames in ((2, 57), (1, 91)):
            mel = mels(batch, frames, seed=batch)
            want_speech, want_source = hift.inference(mel, False)
            speech, source = graphed(mel, False)
            torch.testing.assert_close(speech, want_speech, atol=1e-5, rtol=0)
            torch.testing.assert_close(source, want_source, atol=1e-5, rtol=0)
    assert replayed == [(4, 80, 200), (1, 80, 200)] and len(made) == 2
