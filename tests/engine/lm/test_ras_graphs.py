"""The LM's per-step RAS replayed from a graph per batch bucket (engine.lm.ras_graphs). CUDA graphs are not on
this CPU: a stand-in for CapturedCall records the function on its static inputs as it does (two warm-up
runs, then the recorded call) and a replay reruns it into the same output tensor, so the bucketing, the
padding rows and the captures' effect on the requests' state are tested as they run on the GPU."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from engine.config import SamplingConfig
from engine.lm.ras_graphs import GraphedRAS, batch_bucket, every_bucket, ras_stepper
from engine.lm.sampling import DeviceRAS
from tests.engine.test_graph_cache import emulate_capture

CFG = SamplingConfig()
CPU = torch.device("cpu")


class Recorded:
    """CapturedCall's contract: ``fn`` warmed up and recorded on ``inputs``; ``graph.replay()`` reruns it,
    writing into the tensor ``output`` the capture returned."""

    made: ClassVar[list[Recorded]] = []

    def __init__(self, fn, inputs, pool=None, warmup=2, stream=None):
        for _ in range(warmup):
            fn(*inputs)
        self.fn, self.inputs, self.output = fn, inputs, fn(*inputs)
        self.graph = self
        self.replays = 0
        Recorded.made.append(self)

    def replay(self) -> None:
        self.replays += 1
        self.output.copy_(self.fn(*self.inputs))


@pytest.fixture
def captures(monkeypatch) -> list[Recorded]:
    """Every capture of the graph cache goes through ``Recorded``."""
    return emulate_capture(monkeypatch, Recorded)


def twin_states(rows: int = 8) -> tuple[DeviceRAS, DeviceRAS]:
    """Two equal RAS states: rows 0-5 hold requests (two greedy, one with a minimum length), 6-7 empty."""
    pair = DeviceRAS(40, CPU, CFG, rows=rows, steps=64), DeviceRAS(40, CPU, CFG, rows=rows, steps=64)
    for ras in pair:
        for row in range(6):
            ras.add(row, 100 + row, 4 if row == 2 else 0, [0, 1], greedy=row in (3, 5))
    return pair


def logits_of(batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 40, generator=g) * 4  # peaky: draws repeat, so the RAS fallback fires


def states_equal(a: DeviceRAS, b: DeviceRAS) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a._tensors(), b._tensors()))


def test_buckets_are_powers_of_two_capped_at_the_state_rows():
    assert [batch_bucket(b, 128) for b in (1, 2, 3, 5, 8, 9, 100, 128)] == [1, 2, 4, 8, 8, 16, 128, 128]
    assert batch_bucket(5, 6) == 6  # a state of 6 rows: its last bucket is 6, not 8
    for bad in (0, 129):
        with pytest.raises(ValueError):
            batch_bucket(bad, 128)


def test_every_bucket_of_a_state_is_its_powers_of_two_then_its_rows():
    assert every_bucket(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert every_bucket(6) == [1, 2, 4, 6] and every_bucket(1) == [1]
    for rows in (6, 100, 128):  # exactly the buckets the batches of 1..rows rows go to
        assert {batch_bucket(b, rows) for b in range(1, rows + 1)} == set(every_bucket(rows))


def test_the_first_step_captures_every_bucket_and_no_later_step_captures(captures):
    """A batch size first met under load (32 or 64 rows) would hold every stream of its step for a capture:
    all of them are captured at the first step (the LM's start or the warm-up), exactly as before."""
    eager, state = twin_states(rows=6)
    graphed = GraphedRAS(state, CPU)
    assert torch.equal(graphed.step(logits_of(1, 0)), eager.step(logits_of(1, 0)))
    assert graphed.buckets == [1, 2, 4, 6] and len(captures) == 4
    assert states_equal(eager, state)  # the captures at 0 rows in use moved no request's state
    for step, batch in enumerate([6, 3, 2, 5, 1], start=1):
        assert torch.equal(graphed.step(logits_of(batch, step)), eager.step(logits_of(batch, step)))
    assert len(captures) == 4 and states_equal(eager, state)


def test_replayed_steps_sample_exactly_what_the_eager_steps_sample(captures):
    eager, state = twin_states()
    graphed = GraphedRAS(state, CPU)
    # batches of 3 (bucket 4: row 3 is padding although its request is active), 6, 1, 2 and 5 rows
    for step, batch in enumerate([3, 6, 6, 1, 2, 5, 3, 6, 6, 6, 2, 1]):
        logits = logits_of(batch, step)
        want = eager.step(logits.clone())
        got = graphed.step(logits.clone())
        assert torch.equal(got, want), f"step {step}, {batch} rows"
        assert states_equal(eager, state), f"step {step}: the request state moved apart"
    assert graphed.buckets == [1, 2, 4, 8]
    assert sum(c.replays for c in captures) == 12  # one replay a step, no eager step in between


def test_captures_change_no_request_state(captures):
    """A capture runs the step three times (two warm-ups and the recorded call): at 0 rows in use."""
    fresh, state = twin_states()
    graphed = GraphedRAS(state, CPU)
    graphed._graphs.get(8, graphed._run, lambda: graphed._statics(8, logits_of(8, 0)))
    assert len(captures) == 1 and states_equal(fresh, state)


def test_padding_rows_and_rows_past_the_batch_keep_their_state(captures):
    _, state = twin_states()
    graphed = GraphedRAS(state, CPU)
    before = state.count.clone(), state.window.clone()
    graphed.step(logits_of(3, 1))  # bucket 4: row 3's request is active, but not in this step's batch
    assert state.count.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert torch.equal(state.window[3:], before[1][3:]) and torch.equal(state.count[3:], before[0][3:])


def test_the_stepper_is_eager_where_the_device_has_no_graphs():
    ras = DeviceRAS(40, CPU, CFG, rows=4, steps=8)
    assert ras_stepper(ras, CPU, graphs=True) == ras.step
    assert ras_stepper(ras, CPU, graphs=False) == ras.step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replays_sample_what_the_eager_steps_sample():
    """Real CUDA graphs (one per bucket, one pool) against the eager step, at the v2 LM's vocabulary."""
    cuda = torch.device("cuda")
    pair = DeviceRAS(6564, cuda, CFG, rows=128, steps=512), DeviceRAS(6564, cuda, CFG, rows=128, steps=512)
    for ras in pair:
        for row in range(100):
            ras.add(row, row, 20, [6561, 6562], greedy=row % 7 == 0)
    eager, state = pair
    stepper = ras_stepper(state, cuda, graphs=True)
    g = torch.Generator(device=cuda).manual_seed(0)
    for step, batch in enumerate([1, 3, 16, 100, 64, 5] * 10):
        logits = torch.randn(batch, 6564, generator=g, device=cuda) * 3
        want = eager.step(logits.clone()).argmax(1)
        assert torch.equal(stepper(logits.clone()).argmax(1), want), f"step {step}, {batch} rows"
    assert states_equal(eager, state)
