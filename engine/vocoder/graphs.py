"""v3's causal HiFT as replayed CUDA graphs at bucketed (batch, frames) shapes, for non-final chunks.

Eager, one HiFT call issues ~1,000 ops (convs, Snake activations, the source's sines, STFT and its
inverse) whatever the mel's length: profiled calls take about as long whether the mel holds 2 s or 10 s
(figures: BENCHMARKS.md), so a call is launch-bound. A graph replays all of it in one launch.

Padding is exact where it is used: a non-final call's output covers only frames whose samples do not
depend on later frames (v3's convs are causal and the f0 look-ahead and the iSTFT tail are withheld: the
property that lets each chunk re-vocode all mel so far, and that batching across requests relies on), and
padded rows are independent. Final calls, which vocode up to the right edge, and mel longer than the
largest bucket run eager.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.profiler import record_function

from engine import device as devices
from engine.graph_cache import GraphCache, Later, bucket, largest_first
from engine.vocoder.hift import CausalHiFTGenerator


class GraphedHiFT:
    """Called like ``CausalHiFTGenerator.inference``: (mel [B, 80, T], finalize) -> (speech, source)."""

    def __init__(
        self,
        hift: CausalHiFTGenerator,
        frame_bucket: int = 100,
        max_frames: int = 800,  # 16 s of mel; longer non-final calls run eager
        max_graphs: int = 64,  # > the 40 buckets of batch 1-16 x 100-800 frames: no re-captures
    ):
        if frame_bucket < hift.config.withheld_frames:  # a non-final call's minimum mel
            raise ValueError(f"frame_bucket must be >= {hift.config.withheld_frames}")
        self.hift, self.frame_bucket, self.max_frames = hift, frame_bucket, max_frames
        self.graphs = GraphCache("vocoder", max_graphs, covers=True)  # padding is exact (the docstring)

    def twin(self) -> GraphedHiFT:
        """The same vocoder and settings with a graph cache of its own, none captured: a second worker's (a
        graph's input buffers serve one thread at a time)."""
        return GraphedHiFT(self.hift, self.frame_bucket, self.max_frames, self.graphs.max_graphs)

    def __call__(self, mel: Tensor, finalize: bool) -> tuple[Tensor, Tensor]:
        b, frames = mel.shape[0], mel.shape[2]
        bb, tt = bucket(b, frames, self.frame_bucket)
        if finalize or tt > self.max_frames or not self._fits_noise(tt):
            return self.hift.inference(mel, finalize)
        call = self._graph(bb, tt, mel.device)
        if call is None and (wider := self.graphs.covering((bb, tt))) is not None:
            bb, tt = wider  # its own bucket not captured yet: a wider graph, padded alike
            call = self._graph(bb, tt, mel.device)
        if call is None:  # precaptured, and nothing covers it: no capture on a request's path
            return self.hift.inference(mel, finalize)
        with record_function("t2w.hift.graph"):
            speech, source = call.replay(_padded(mel, bb, tt))
        c = self.hift.config
        kept = frames - c.withheld_frames  # emitted frames: the f0 and conv_pre look-ahead, one iSTFT tail
        f0_frames = frames - c.f0_predictor.look_ahead
        return speech[:b, : kept * c.samples_per_frame], source[:b, :, : f0_frames * c.samples_per_frame]

    def precapture(
        self, max_batch: int, max_frames: int, device: torch.device, later: Later | None = None
    ) -> int:
        """Capture every (batch, frames) bucket up to these sizes, largest first (with ``later``, a
        background builder's ``add``, the first few now and the rest there); returns how many."""
        top_frames = max(min(max_frames, self.max_frames), 1)
        top_batch, top_frames = bucket(max_batch, top_frames, self.frame_bucket)
        keys = largest_first(top_batch, top_frames, self.frame_bucket)
        keys = [(b, t) for b, t in keys if self._fits_noise(t)]
        return self.graphs.precapture(keys, lambda key: self._graph(*key, device), device, later)

    def _fits_noise(self, frames: int) -> bool:
        """The fixed noise buffer covers a padded call's f0 frames (``noise_max_samples`` is a setting: with
        a short buffer the long buckets stay eager)."""
        c = self.hift.config
        return (frames - c.f0_predictor.look_ahead) * c.samples_per_frame <= c.noise_max_samples

    def _graph(self, batch: int, frames: int, dev: torch.device) -> devices.CapturedCall | None:
        def run(mel: Tensor) -> tuple[Tensor, Tensor]:
            return self.hift.inference(mel, False)

        def statics() -> tuple[Tensor]:
            return (torch.zeros(batch, self.hift.config.in_channels, frames, device=dev),)

        return self.graphs.get((batch, frames), run, statics)


def _padded(mel: Tensor, batch: int, frames: int) -> Tensor:
    """mel [B, 80, T] in the top-left corner of a zero [batch, 80, frames] tensor."""
    out = mel.new_zeros(batch, mel.shape[1], frames)
    out[: mel.shape[0], :, : mel.shape[2]] = mel
    return out
