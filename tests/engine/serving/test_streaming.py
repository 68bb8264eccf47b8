"""Chunk schedule and vocoder continuations (with fake vocoders; the real ones are tested in models/)."""

from collections.abc import Callable

import numpy as np
import pytest
import torch

from engine.config import StreamConfig
from engine.serving.streaming import ChunkJob, ChunkPlanner
from engine.vocoder.streaming import V2VocoderState, V3VocoderState, crossfade, hamming
from tests.conftest import fixture_file, tiny_cases

CFG = StreamConfig()


def drain(planner: ChunkPlanner, total: int) -> list[ChunkJob]:
    """Feed tokens one at a time as an LM would, then signal the end."""
    jobs = []
    for n in range(1, total + 1):
        while (job := planner.next_job(n, lm_done=False)) is not None:
            jobs.append(job)
    while (job := planner.next_job(total, lm_done=True)) is not None:
        jobs.append(job)
    return jobs


def test_chunks_after_the_first_start_at_their_first_tokens_frame_under_an_untrimmed_prompt():
    """A VC prompt of 2P - 1 mel frames (P = 158, as an example voice gives): the flow's output starts at
    frame 315, so a chunk from token t starts at output frame 2t + 1, the frame after the chunk before
    it and the reusing flow cache's boundary (the reference's 2t would repeat a frame at every seam)."""
    jobs = drain(ChunkPlanner(158, CFG, prompt_frames=315), total=100)
    # pad = 175 - 158 = 17: the first chunk is 42 tokens, ending at frame 2 x (158 + 42) = 400 = 315 + 85
    assert jobs == [ChunkJob(45, 0, False), ChunkJob(95, 85, False), ChunkJob(100, 185, True)]
    over = drain(ChunkPlanner(158, CFG, prompt_frames=317), total=100)  # 2P + 1: the output starts later
    assert [j.mel_start for j in over] == [0, 83, 183]
    assert drain(ChunkPlanner(158, CFG, prompt_frames=316), 100) == drain(ChunkPlanner(158, CFG), 100)


def test_first_hop_pads_to_the_chunk_grid_then_doubles_to_100():
    jobs = drain(ChunkPlanner(prompt_tokens=10, cfg=CFG), total=400)
    # pad = 25 - 10 = 15: first chunk 40 tokens (+3 look-ahead), then 50, 100, 100 ...
    assert [j.end for j in jobs[:4]] == [43, 93, 193, 293]
    assert [j.mel_start for j in jobs[:4]] == [0, 80, 180, 380]
    assert not any(j.finalize for j in jobs[:-1])
    assert jobs[-1] == ChunkJob(400, 2 * 390, True)  # 290 + 100 + 3 <= 400: one more hop first


def test_matches_the_reference_v3_e2e_schedule():
    # the official tts loop: 10 prompt tokens, 50 tokens -> chunk of 43 tokens, then the final flush.
    jobs = drain(ChunkPlanner(10, CFG), 50)
    assert jobs == [ChunkJob(43, 0, False), ChunkJob(50, 80, True)]


E2E_CASES = [c for c in tiny_cases() if (c / "ref_e2e.npz").is_file()]


@pytest.mark.skipif(not E2E_CASES, reason="no fixture case with ref_e2e.npz")
@pytest.mark.parametrize("case", E2E_CASES, ids=[c.parent.name for c in E2E_CASES])
def test_matches_each_fixture_e2e_schedule(case):
    """As many chunks as the reference's streaming tts gave, the first one as long as its first chunk."""
    flow_in, e2e = np.load(fixture_file(case / "ref_flow.npz")), np.load(case / "ref_e2e.npz")
    jobs = drain(ChunkPlanner(flow_in["prompt_token"].shape[1], CFG), flow_in["token"].shape[1])
    assert len(jobs) == int(e2e["stream_num_chunks"])
    if len(jobs) > 1:
        assert jobs[0].end == int(flow_in["stream_chunk0_num_tokens"])


def test_each_request_starts_at_the_first_hop():
    # The reference leaves the grown hop on the model; a second request must not inherit it.
    first = drain(ChunkPlanner(25, CFG), 300)
    second = drain(ChunkPlanner(25, CFG), 300)
    assert first == second and first[0].end == 28


def test_non_streaming_is_one_final_job():
    assert drain(ChunkPlanner(10, CFG, stream=False), 120) == [ChunkJob(120, 0, True)]


def test_no_job_while_waiting_for_lookahead():
    planner = ChunkPlanner(0, CFG)
    assert planner.next_job(27, lm_done=False) is None
    assert planner.next_job(28, lm_done=False) == ChunkJob(28, 0, False)


def test_crossfade_blends_with_hamming_halves():
    w = hamming(8)
    out = crossfade(torch.ones(1, 10), torch.zeros(1, 6), w)
    assert torch.allclose(out[0, :4], w[:4]) and torch.equal(out[0, 4:], torch.ones(6))


def fake_hift2(mel: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # A "vocoder" whose output is a smooth function of the frame values: 480 samples per frame.
    speech = mel.mean(1).repeat_interleave(480, dim=1)
    return speech, speech.unsqueeze(1)


def test_v2_stream_equals_one_shot_away_from_the_seams():
    mel = torch.linspace(0, 1, 80).repeat(1, 80, 1)  # [1, 80, 80] smooth ramp
    state = V2VocoderState(CFG)
    parts = [state.step(mel[:, :, :30], False, fake_hift2), state.step(mel[:, :, 30:], True, fake_hift2)]
    streamed = torch.cat(parts, dim=1)
    whole, _ = fake_hift2(mel, torch.zeros(1, 1, 0))
    assert streamed.shape == whole.shape
    # away from the cross-fade the samples are identical; inside it the ramp stays within its neighbours
    assert torch.allclose(streamed[:, : 22 * 480], whole[:, : 22 * 480])
    assert torch.allclose(streamed[:, 30 * 480 :], whole[:, 30 * 480 :])


def test_v2_step_parts_change_the_state_only_on_commit():
    """``prepared`` and ``faded`` leave the state as it was, so a batch that fails after them can retry the
    row; prepared + HiFT + faded + commit is ``step``."""
    mel = torch.linspace(0, 1, 80).repeat(1, 80, 1)
    state, ref = V2VocoderState(CFG), V2VocoderState(CFG)
    for part, finalize in ((mel[:, :, :30], False), (mel[:, :, 30:50], False), (mel[:, :, 50:], True)):
        call = state.prepared(part, finalize)
        speech, source = fake_hift2(call.mel, call.source)
        state.faded(speech)
        again = state.prepared(part, finalize)  # nothing moved
        assert torch.equal(again.mel, call.mel) and torch.equal(again.source, call.source)
        assert call.mel.shape[2] == part.shape[2] + (0 if state.mel is None else CFG.mel_cache_frames)
        played = state.commit(call, state.faded(speech), source)
        assert torch.equal(played, ref.step(part, finalize, fake_hift2))


def test_v3_emits_each_sample_once():
    def causal(mel: torch.Tensor, finalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        keep = mel.shape[2] if finalize else mel.shape[2] - 8
        speech = mel[0, 0, :keep].repeat_interleave(480).unsqueeze(0)
        return speech, speech.unsqueeze(1)

    mel = torch.arange(60.0).repeat(1, 80, 1)
    state = V3VocoderState()
    parts = [state.step(mel[:, :, :20], False, causal), state.step(mel[:, :, 20:], True, causal)]
    assert torch.equal(torch.cat(parts, 1), causal(mel, True)[0])
    assert parts[0].shape[1] == 12 * 480


def test_silence_filter_keeps_five_consecutive_silent_tokens():
    from engine.serving.streaming import SILENT_TOKENS_V3, SilenceFilter

    f = SilenceFilter(SILENT_TOKENS_V3)
    seq = [7] + [1] * 8 + [9] + [2] * 3
    kept = [t for t in seq if f.keep(t)]
    assert kept == [7] + [1] * 5 + [9] + [2] * 3


def test_fast_start_splits_the_first_chunk_at_the_grid_and_keeps_every_later_boundary():
    fast = StreamConfig(fast_start=True)
    ref = drain(ChunkPlanner(prompt_tokens=10, cfg=CFG), total=400)
    got = drain(ChunkPlanner(prompt_tokens=10, cfg=fast), total=400)
    # pad = 15 >= 12: 15 tokens first (prompt 10 + 15 = 25, on the grid), then 25 = the reference's 40
    assert [j.end for j in got[:5]] == [18, 43, 93, 193, 293]
    assert [j.end for j in got[1:]] == [j.end for j in ref]  # from there on: the reference schedule
    assert got[0] == ChunkJob(18, 0, False) and got[1].mel_start == 30


def test_fast_start_keeps_the_reference_first_chunk_when_the_pad_is_short():
    fast = StreamConfig(fast_start=True)
    for prompt in (25, 20, 14):  # pad 0, 5, 11 < 12: splitting would leave too little audio
        assert drain(ChunkPlanner(prompt, fast), 300) == drain(ChunkPlanner(prompt, CFG), 300)


@pytest.mark.parametrize(("first_hop", "split"), [(12, 13), (8, 17)])
def test_over_every_prompt_length_the_fast_start_splits_where_the_grid_offset_allows(first_hop, split):
    """What README and BENCHMARKS say of prompts of any length: over one chunk of prompt lengths the offset
    to the grid takes every value once, and the split (first chunk = offset + look-ahead tokens) comes for
    offsets >= min_first_hop: 13 of 25 at the default (12), 17 with bench --ab short-split's 8; the rest
    keep the reference's 28-39 tokens. The bench's one prompt (87 tokens) has offset 13: 16 tokens."""
    fast = StreamConfig(fast_start=True, min_first_hop=first_hop)
    firsts = [drain(ChunkPlanner(tokens, fast), 300)[0].end for tokens in range(87, 112)]
    la = fast.lookahead
    assert sum(end < fast.token_hop + la for end in firsts) == split
    assert {end for end in firsts if end >= fast.token_hop + la} == set(range(28, 28 + 25 - split))
    assert firsts[0] == 13 + la == 16 and max(firsts) == 25 + first_hop - 1 + la


def test_with_the_prompt_trim_every_prompt_length_splits_after_its_cut():
    """fast_start_trim 12: over one chunk of prompt lengths each offset below 12 is cut up to exactly 12
    (cut = 12 - offset, at most 12 tokens), so every first chunk splits: 12-24 tokens and the look-ahead."""
    trim = StreamConfig(fast_start=True, fast_start_trim=12)
    cuts = {tokens: trim.flow_prompt_cut(tokens) for tokens in range(87, 112)}
    assert {(-t % 25, c) for t, c in cuts.items() if c} == {(pad, 12 - pad) for pad in range(12)}
    firsts = [drain(ChunkPlanner(tokens - cut, trim), 300)[0].end for tokens, cut in cuts.items()]
    la = trim.lookahead
    assert sorted(firsts) == [12 + la] * 13 + list(range(13 + la, 25 + la))


def test_the_prompt_trim_cuts_only_what_the_split_needs():
    trim = StreamConfig(fast_start=True, fast_start_trim=12)
    assert trim.flow_prompt_cut(95) == 7  # offset 5: 7 tokens off the head leave offset 12
    assert trim.flow_prompt_cut(88) == 0  # offset 12 splits as it is
    assert trim.flow_prompt_cut(20) == 0  # the cut would leave less than a chunk of prompt
    assert StreamConfig(fast_start=True, fast_start_trim=6).flow_prompt_cut(95) == 0  # 7 > 6
    for no_split in (False, None):  # None: auto, unresolved (the engine resolves it per request)
        assert StreamConfig(fast_start=no_split, fast_start_trim=12).flow_prompt_cut(95) == 0
    assert StreamConfig(fast_start=True).flow_prompt_cut(95) == 0  # off by default
    with pytest.raises(ValueError, match="fast_start_trim"):
        StreamConfig(fast_start_trim=13)


def test_min_first_hop_must_leave_audio_and_stay_below_the_hop():
    import pytest

    for bad in (4, 25):
        with pytest.raises(ValueError, match="min_first_hop"):
            StreamConfig(min_first_hop=bad)


ADAPTIVE = StreamConfig(adaptive_hop=True, hold_buffer_s=3.0, max_adaptive_hop=200)


def drain_buffered(planner: ChunkPlanner, total: int, buffered: Callable[[int], float]) -> list[ChunkJob]:
    """As ``drain``, with ``buffered(n)`` seconds of audio at the client when the n-th token arrives."""
    jobs = []
    for n in range(1, total + 1):
        while (job := planner.next_job(n, lm_done=False, buffered_s=buffered(n))) is not None:
            jobs.append(job)
    while (job := planner.next_job(total, lm_done=True, buffered_s=buffered(total))) is not None:
        jobs.append(job)
    return jobs


def boundaries(jobs: list[ChunkJob]) -> set[int]:
    return {j.mel_start // 2 for j in jobs}


def test_adaptive_hops_merge_reference_chunks_while_the_buffer_is_full():
    ref = drain(ChunkPlanner(10, CFG), 700)  # boundaries 40, 90, 190, 290, ... ; final from 690
    got = drain_buffered(ChunkPlanner(10, ADAPTIVE), 700, lambda n: 0.0 if n < 100 else 5.0)
    assert boundaries(got) <= boundaries(ref)  # every chunk starts (and ends) on a reference boundary
    assert got[-1] == ref[-1]  # the same final call
    assert [j.end for j in got] == [43, 93, 293, 493, 693, 700]  # 40, 50, then 200 + 200 + 200
    assert all(j.end - 3 - j.mel_start // 2 <= 200 for j in got[:-1])


def test_adaptive_hops_without_buffered_audio_follow_the_reference():
    ref = drain(ChunkPlanner(10, CFG), 700)
    assert drain_buffered(ChunkPlanner(10, ADAPTIVE), 700, lambda n: 0.0) == ref
    assert drain_buffered(ChunkPlanner(10, CFG), 700, lambda n: 9.0) == ref  # off: buffer ignored


def test_a_buffer_running_low_releases_every_ready_boundary_in_one_chunk():
    # full buffer from token 96 to 349: the reference chunks 90-190 and 190-290 are held (a third would
    # still fit 400 tokens); when the buffer runs low at token 350 both go out as one job, the rest as usual
    cfg = StreamConfig(adaptive_hop=True, hold_buffer_s=3.0, max_adaptive_hop=400)
    got = drain_buffered(ChunkPlanner(10, cfg), 500, lambda n: 5.0 if 95 < n < 350 else 0.0)
    assert [(j.mel_start // 2, j.end) for j in got] == [
        (0, 43),
        (40, 93),
        (90, 293),
        (290, 393),
        (390, 493),
        (490, 500),
    ]
    assert boundaries(got) <= boundaries(drain(ChunkPlanner(10, CFG), 500))


def test_adaptive_settings_are_checked():
    import pytest

    with pytest.raises(ValueError, match="max_adaptive_hop"):
        StreamConfig(max_adaptive_hop=50)
    assert StreamConfig().adapts_hops("cosyvoice3", 8) and not StreamConfig().adapts_hops("cosyvoice3", 7)
    assert not StreamConfig().adapts_hops("cosyvoice2", 64)
    assert StreamConfig(adaptive_hop=True).adapts_hops("cosyvoice2", 1)


def test_only_a_whole_file_call_at_another_speed_stretches() -> None:
    from engine.vocoder.streaming import stretches

    assert stretches(finalize=True, speed=1.5, fresh=True)
    assert not stretches(finalize=True, speed=1.0, fresh=True)
    assert not stretches(finalize=False, speed=1.5, fresh=True)
    assert not stretches(finalize=True, speed=1.5, fresh=False)
