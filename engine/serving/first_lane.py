"""The first-chunk lane's parts (``EngineConfig.t2w_first_lane``): what a second token2wav worker runs.

Under a steady open-loop load a new request's first chunk waits for the one token2wav worker: for a call
of other streams' rows already running, often rows with seconds of audio buffered (BENCHMARKS.md, the
steady-state trace: 67 ms of wait on a 341 ms first chunk at 5 requests/s). The lane is a second worker
thread, on a device stream of its own, that takes first chunks only (``Token2Wav.open_first_lane``). It
needs graphs of its own, since a graph's input buffers serve one thread at a time: a twin of the flow's
graphs at a first chunk's shapes (batch 1, sharing the solver, its compiled programs and the page pool)
and of the vocoder's. With background graphs they are the builder's last job, captured of the solver
serving by then (the compiled one); without graphs (the CPU) the lane runs the same modules at once.
"""

from __future__ import annotations

import copy
import threading
from typing import TYPE_CHECKING

import torch

from engine import device as devices
from engine.flow.graphs import GraphedCFM
from engine.vocoder.graphs import GraphedHiFT

if TYPE_CHECKING:
    from engine.flow.cfm import Flow
    from engine.serving.token2wav import Token2Wav

FIRST_MEL_FRAMES = 200  # the vocoder's graphs of a first chunk: its mel alone (no prompt), 4 s at most


def refusal(flow: Flow, device: torch.device) -> str | None:
    """Why the lane cannot run beside the main worker here (None: it can). On a GPU it needs the graphed
    solver, which keeps no tensor per request (pages of one pool, or none): the eager solver's frame caches
    grow per request on the worker's stream, and one made on the lane's stream and freed on the main one's
    could be written under that stream's reads."""
    if devices.is_accelerator(device) and not isinstance(flow.decoder, GraphedCFM):
        return "the first-chunk lane needs the graphed flow solver on a GPU (--no-cuda-graphs turns it off)"
    return None


def open_lane(
    t2w: Token2Wav,
    flow: Flow,
    hift: GraphedHiFT | None,
    max_frames: int,
    device: torch.device,
    stop: threading.Event | None = None,
) -> None:
    """Capture the lane's graphs (a flow call of up to ``max_frames`` mel frames, prompt included; paced
    by ``stop``, a builder's, which also ends it early), then open the lane on ``t2w``."""
    lane_flow = flow
    if isinstance(flow.decoder, GraphedCFM):
        twin = flow.decoder.twin()
        twin.precapture_first(max_frames, device, stop)
        lane_flow = with_decoder(flow, twin)
    graphs = None
    if hift is not None:
        graphs = hift.twin()
        graphs.precapture(1, FIRST_MEL_FRAMES, device)
    if stop is None or not stop.is_set():
        t2w.open_first_lane(lane_flow, graphs)


def with_decoder(flow: Flow, decoder: GraphedCFM) -> Flow:
    """``flow`` with another solver: a shallow copy sharing every other module (no weight is copied)."""
    twin = copy.copy(flow)
    twin._modules = dict(flow._modules)  # the copy's own module table: setting its decoder leaves flow's
    twin.decoder = decoder  # type: ignore[assignment]  # the solver's drop-in
    return twin
