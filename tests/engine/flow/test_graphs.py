"""The graphed solver's padding (bucketed batch and frames) leaves the real rows and frames unchanged.

CUDA graph capture itself needs a GPU (tests marked gpu); the exactness of the padding it relies on is a
property of the flow and is checked here on CPU with the eager solver.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engine.checkpoint import load_model
from engine.demo.make_model import build_model_dir
from engine.flow.cfm import CfmInputs, FlowBatch
from engine.flow.graphs import GraphedCFM, _padded
from engine.hub import validate_model_dir


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def flow(request, tmp_path_factory):
    model_dir = build_model_dir(tmp_path_factory.mktemp(request.param), request.param, "tiny")
    return load_model(validate_model_dir(model_dir), torch.device("cpu")).flow


def inputs(flow, rows: list[tuple[int, int]], finalize: bool, streaming: bool) -> CfmInputs:
    g = torch.Generator().manual_seed(0)
    b = len(rows)
    p_max, n_max = max(p for p, _ in rows), max(n for _, n in rows)
    batch = FlowBatch(
        token=torch.randint(0, 6561, (b, n_max), generator=g),
        token_len=torch.tensor([n for _, n in rows]),
        prompt_token=torch.randint(0, 6561, (b, p_max), generator=g),
        prompt_token_len=torch.tensor([p for p, _ in rows]),
        prompt_feat=torch.randn(b, 2 * p_max, 80, generator=g),
        prompt_feat_len=torch.tensor([2 * p for p, _ in rows]),
        embedding=torch.randn(b, 192, generator=g),
    )
    return flow.prepare(batch, streaming=streaming, finalize=finalize)


@pytest.mark.parametrize("streaming", [True, False])
def test_padding_to_a_bucket_is_exact(flow, streaming):
    x = inputs(flow, [(9, 40), (13, 52), (20, 31)], finalize=not streaming, streaming=streaming)
    b, t = x.mu.shape[0], x.mu.shape[2]
    graphed = GraphedCFM(flow.decoder, frame_bucket=100)
    bb, tt = graphed.bucket(b, t)
    assert (bb, tt) == (4, 100 * -(-t // 100))
    mu, mask, spks, cond = _padded(x, bb, tt)
    frames = torch.zeros(bb, dtype=torch.long)
    with torch.inference_mode():
        padded = flow.decoder(CfmInputs(mu, mask, spks, cond, frames, frames), streaming)[:b, :, :t]
        plain = flow.decoder(x, streaming)
    valid = x.mask.bool().expand_as(plain)
    torch.testing.assert_close(padded[valid], plain[valid], atol=2e-5, rtol=1e-5)
    assert torch.isfinite(padded).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graphed_solver_matches_eager_and_keeps_each_result_on_cuda(flow, monkeypatch):
    dev = torch.device("cuda")
    # true float32: with cuDNN's default TF32 convolutions, the padded (graph) and the exact (eager) shapes
    # pick different kernels and differ by ~1e-3 on v2's conv decoder (H200, 2026-11-30)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    with torch.inference_mode():  # the solver's inputs, prepared by the CPU flow, then moved
        first = on_device(inputs(flow, [(9, 40), (13, 52)], finalize=False, streaming=True), dev)
        second = on_device(inputs(flow, [(11, 41), (12, 50)], finalize=False, streaming=True), dev)
    gpu = copy.deepcopy(flow).to(dev)
    graphed = GraphedCFM(gpu.decoder, frame_bucket=100)
    assert graphed.precapture(4, 250, dev) == 3 * 3 * 2  # batch 1,2,4 x frames 100..300 x streaming
    with torch.inference_mode():
        a = graphed(first, True)
        kept = a.clone()
        graphed(second, True)  # the same bucket replays: ``a`` must not change under the caller
        eager = gpu.decoder(first, True)
    assert not a.requires_grad and not graphed.graphs[(2, 200, True)].output.requires_grad
    torch.testing.assert_close(a, kept, atol=0, rtol=0)
    valid = first.mask.bool().expand_as(eager)
    torch.testing.assert_close(a[valid], eager[valid], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_call_replays_the_widest_captured_graph_on_cuda_exactly(flow, monkeypatch):
    """The cover on real CUDA graphs: with only the first graphs captured, a 2-row call of ~130 frames
    replays the (4, 300) graph and equals the eager solve."""
    dev = torch.device("cuda")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # as above: exact kernels both ways
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    with torch.inference_mode():
        x = on_device(inputs(flow, [(9, 40), (13, 52)], finalize=False, streaming=True), dev)
    gpu = copy.deepcopy(flow).to(dev)
    graphed = GraphedCFM(gpu.decoder, frame_bucket=100)
    assert graphed.precapture(4, 250, dev, lambda name, job: None) == 18
    assert sorted(graphed.graphs.keys()) == [(1, 300, False), (1, 300, True), (4, 300, False), (4, 300, True)]
    with torch.inference_mode():
        got, eager = graphed(x, True), gpu.decoder(x, True)
    assert len(graphed.graphs) == 4 and graphed.graphs.covering((2, 200, True)) == (4, 300, True)
    valid = x.mask.bool().expand_as(eager)
    torch.testing.assert_close(got[valid], eager[valid], atol=1e-4, rtol=1e-4)


def on_device(x: CfmInputs, dev: torch.device) -> CfmInputs:
    return CfmInputs(*(getattr(x, f.name).to(dev) for f in dataclasses.fields(x)))


def test_precapture_covers_every_bucket_largest_first(flow, monkeypatch):
    """All (batch, frames, streaming) buckets up to the limits, biggest first (the shared pool then
    reuses the first capture's blocks); capture itself is replaced by a recorder (no GPU here)."""
    graphed = GraphedCFM(flow.decoder, frame_bucket=100)
    seen: list[tuple[int, int, bool]] = []
    monkeypatch.setattr(graphed, "_captured", lambda key, dev: seen.append(key))
    monkeypatch.setattr("engine.flow.graphs.devices.empty_cache", lambda dev: None)
    assert graphed.precapture(5, 250, torch.device("cpu")) == len(seen) == 4 * 3 * 2
    assert seen[0] == (8, 300, True) and seen[-1] == (1, 100, False)
    assert sorted(set(seen), reverse=True) == sorted(seen, reverse=True)  # no bucket twice
    order = [(b, t) for b, t, _ in seen]
    assert order == sorted(order, reverse=True)  # batch, then frames, never growing
    assert graphed.graphs.max_graphs >= len(seen)


def relative_rms(ref: torch.Tensor, low: torch.Tensor, valid: torch.Tensor) -> float:
    """The fidelity figure: RMS of the mel difference over the valid frames, relative to the mel's std."""
    return float((ref[valid] - low[valid]).pow(2).mean().sqrt() / ref[valid].std())


def test_bfloat16_solver_stays_finite_and_close_to_float32(flow):
    """The precision check behind ``flow_dtype=bfloat16``: on random weights the solve with the weights
    held in bf16 (CPU here) must stay finite and within 5 % RMS of the fp32 mel (full size on CPU: 0.7 %)."""
    x = inputs(flow, [(9, 40), (13, 52)], finalize=True, streaming=False)
    with torch.inference_mode():
        ref = GraphedCFM(flow.decoder, torch.float32).solver(x, False)
        low = GraphedCFM(flow.decoder, torch.bfloat16).solver(x, False)
    valid = x.mask.bool().expand_as(ref)
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    assert 0 < relative_rms(ref, low, valid) < 0.05  # > 0: bf16 really ran


def test_float32_solver_is_the_reference_module(flow):
    """float32 keeps the loaded estimator itself (no copy): the exact reference path."""
    graphed = GraphedCFM(flow.decoder, torch.float32)
    assert graphed.solver.estimator.inner is flow.decoder.estimator
    assert graphed.solver.noise is flow.decoder.noise


def test_compiled_solver_equals_eager(flow):
    """Inductor (its CPU backend here) compiles one dynamic program: at two bucket shapes the real rows and
    frames equal the eager float32 solve."""
    graphed = GraphedCFM(flow.decoder, torch.float32, compiled=True)
    for rows in ([(9, 40), (13, 52)], [(11, 70)]):
        x = inputs(flow, rows, finalize=False, streaming=True)
        with torch.inference_mode():
            fast = graphed.solver(x, True)
            eager = flow.decoder(x, True)
        valid = x.mask.bool().expand_as(eager)
        torch.testing.assert_close(fast[valid], eager[valid], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_bf16_graphs_stay_close_to_float32_eager(flow):
    """The fidelity guard of the fast path on the GPU: compiled bf16 estimator inside the CUDA graphs vs
    the eager float32 reference solve, mel RMS error relative to the mel's std (tiny random weights)."""
    dev = torch.device("cuda")
    gpu = copy.deepcopy(flow).to(dev)
    graphed = GraphedCFM(gpu.decoder, torch.bfloat16, compiled=True)
    with torch.inference_mode():
        x = on_device(inputs(flow, [(9, 40), (13, 52)], finalize=False, streaming=True), dev)
        fast = graphed(x, True)
        ref = gpu.decoder(x, True)
    valid = x.mask.bool().expand_as(ref)
    assert torch.isfinite(fast).all() and relative_rms(ref, fast, valid) < 0.05


def test_graphed_forward_pads_replays_and_slices_like_eager(flow, monkeypatch):
    """The whole graphed path on the CPU with the capture emulated: pre-captured buckets are replayed (no
    new capture), results are copies, and the real rows and frames equal the eager solve."""
    from tests.engine.test_graph_cache import emulate_capture

    made = emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.flow.graphs.devices.empty_cache", lambda dev: None)
    first = inputs(flow, [(9, 40), (13, 52)], finalize=False, streaming=True)
    graphed = GraphedCFM(flow.decoder, frame_bucket=100)
    assert graphed.precapture(4, 250, torch.device("cpu")) == len(made) == 18
    with torch.inference_mode():
        a = graphed(first, True)
        kept = a.clone()
        graphed(inputs(flow, [(11, 41), (12, 50)], finalize=False, streaming=True), True)
        eager = flow.decoder(first, True)
    assert len(made) == 18  # both calls replayed the (2, 200, streaming) bucket
    torch.testing.assert_close(a, kept, atol=0, rtol=0)
    valid = first.mask.bool().expand_as(eager)
    torch.testing.assert_close(a[valid], eager[valid], atol=1e-4, rtol=1e-4)


def test_after_precapture_a_longer_call_runs_uncaptured(flow, monkeypatch):
    """Mel beyond the pre-captured buckets takes the solver uncaptured, exactly, and captures nothing."""
    from tests.engine.test_graph_cache import emulate_capture

    made = emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.flow.graphs.devices.empty_cache", lambda dev: None)
    graphed = GraphedCFM(flow.decoder, frame_bucket=100)
    assert graphed.precapture(2, 100, torch.device("cpu")) == len(made) == 4  # batch 2, 1 x 100 x streaming
    x = inputs(flow, [(20, 90)], finalize=False, streaming=True)  # > 100 frames
    assert x.mu.size(2) > 100
    with torch.inference_mode():
        got, eager = graphed(x, True), flow.decoder(x, True)
    assert len(made) == 4
    valid = x.mask.bool().expand_as(eager)
    torch.testing.assert_close(got[valid], eager[valid], atol=1e-5, rtol=1e-5)


def test_before_its_bucket_is_captured_a_call_replays_the_widest_graph_exactly(flow, monkeypatch):
    """Served from the first request on: with the other buckets left to the background builder, a call of
    any batch and length up to the top replays the widest graph of its kind (padded) instead of running
    the solver op by op, and its real frames equal the eager solve."""
    from tests.engine.test_graph_cache import Recorded, emulate_capture

    made = emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.flow.graphs.devices.empty_cache", lambda dev: None)
    replayed: list[tuple[int, ...]] = []
    replay = Recorded.replay

    def counted(self, *values):
        replayed.append(tuple(self.inputs[0].shape))  # mu [B,80,T] of the graph replayed
        return replay(self, *values)

    monkeypatch.setattr(Recorded, "replay", counted)
    graphed, queued = GraphedCFM(flow.decoder, frame_bucket=100), []
    assert graphed.precapture(4, 250, torch.device("cpu"), lambda name, job: queued.append(name)) == 18
    assert sorted(m[0] for m in made) == [(1, 80, 300)] * 2 + [(4, 80, 300)] * 2 and queued
    one = inputs(flow, [(9, 40)], finalize=False, streaming=True)
    three = inputs(flow, [(9, 40), (13, 52), (20, 31)], finalize=True, streaming=False)
    assert one.mu.size(2) <= 100 and 100 < three.mu.size(2) <= 200
    with torch.inference_mode():
        got = [graphed(one, True), graphed(three, False)]
        eager = [flow.decoder(one, True), flow.decoder(three, False)]
    assert replayed == [(1, 80, 300), (4, 80, 300)] and len(made) == 4  # no capture on the way
    for x, g, e in zip((one, three), got, eager):
        valid = x.mask.bool().expand_as(e)
        torch.testing.assert_close(g[valid], e[valid], atol=1e-4, rtol=1e-4)


def test_step_graphs_capture_one_step_replay_it_a_step_and_equal_the_whole_solve_graphs(flow, monkeypatch):
    """``stepped``: every bucket's graph records one solver step on (x, step index, *bucket inputs), a call
    replays it once a step (10 runs of the step, none of a whole solve), and its output equals the whole
    solve's graph to the bit, for streaming and final calls, padded rows and frames included; a result is
    a copy that the next replay leaves alone."""
    from tests.engine.test_graph_cache import emulate_capture

    made = emulate_capture(monkeypatch)
    monkeypatch.setattr("engine.flow.graphs.devices.empty_cache", lambda dev: None)
    whole, stepped = GraphedCFM(flow.decoder), GraphedCFM(flow.decoder, stepped=True)
    assert whole.precapture(4, 250, torch.device("cpu")) == 18
    assert stepped.precapture(4, 250, torch.device("cpu")) == 18
    shapes = made[18:]
    assert all(len(s) == 6 and s[1] == (1,) and s[0] == s[2] for s in shapes)  # x, step, mu, mask, spks, cond
    steps: list[int] = []
    solve_step = stepped.solver.solve_step

    def counted(x, step, inputs, streaming):
        steps.append(int(step))
        return solve_step(x, step, inputs, streaming)

    monkeypatch.setattr(stepped.solver, "solve_step", counted)
    streaming = inputs(flow, [(9, 40), (13, 52)], finalize=False, streaming=True)
    final = inputs(flow, [(9, 40), (13, 52), (20, 31)], finalize=True, streaming=False)
    with torch.inference_mode():
        a = stepped(streaming, True)
        kept = a.clone()
        assert steps == list(range(10))
        b = stepped(final, False)
        want_a, want_b = whole(streaming, True), whole(final, False)
    assert len(made) == 36 and steps == 2 * list(range(10))  # replays, no capture on the way
    assert torch.equal(a, want_a) and torch.equal(b, want_b) and torch.equal(a, kept)
    eager = flow.decoder(streaming, True)
    valid = streaming.mask.bool().expand_as(eager)
    torch.testing.assert_close(a[valid], eager[valid], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_step_graphs_equal_the_whole_solve_graphs_on_cuda(flow):
    """Real CUDA graphs: the step graphs (one step captured, replayed once a step with the index set on the
    device between replays) compute what the whole solve's graphs compute, streaming and final."""
    dev = torch.device("cuda")
    with torch.inference_mode():
        calls = [
            (on_device(inputs(flow, [(9, 40), (13, 52)], finalize=False, streaming=True), dev), True),
            (on_device(inputs(flow, [(9, 40), (20, 31)], finalize=True, streaming=False), dev), False),
        ]
    gpu = copy.deepcopy(flow).to(dev)
    whole, stepped = GraphedCFM(gpu.decoder), GraphedCFM(gpu.decoder, stepped=True)
    assert whole.precapture(2, 250, dev) == stepped.precapture(2, 250, dev) == 12
    with torch.inference_mode():
        for x, streaming in calls:
            torch.testing.assert_close(stepped(x, streaming), whole(x, streaming), atol=1e-6, rtol=1e-6)
