"""Configuration validation: defaults are the released checkpoints' values; bad values fail at once."""

from __future__ import annotations

import pytest

from engine.config import (
    DEFAULT_MODEL,
    FAST_START_CHOICES,
    EngineConfig,
    Limits,
    SamplingConfig,
    StreamConfig,
    fast_start_choice,
    fast_start_flag,
)
from engine.request import Mode, SynthesisRequest


def test_defaults_are_the_released_values():
    s, st = SamplingConfig(), StreamConfig()
    assert (s.top_p, s.top_k, s.win_size, s.tau_r) == (0.8, 25, 10, 0.1)
    assert (s.min_token_text_ratio, s.max_token_text_ratio) == (2.0, 20.0)
    assert (st.token_hop, st.max_token_hop, st.lookahead, st.mel_cache_frames, st.source_cache_samples) == (
        25, 100, 3, 8, 3840,
    )  # fmt: skip
    assert EngineConfig().model == "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
    assert EngineConfig().flow_reuse is None  # auto: see test_flow_reuse_auto_is_on_but_for_v2s_graphs


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: EngineConfig(backend="tensorrt"), "backend"),
        (lambda: EngineConfig(device="tpu"), "device"),
        (lambda: EngineConfig(flow_dtype="float16"), "flow_dtype"),
        (lambda: EngineConfig(flow_batch=0), "flow_batch"),
        (lambda: EngineConfig(flow_batch=65), "flow_batch"),
        (lambda: EngineConfig(flow_reuse_gb=-1.0), "flow_reuse_gb"),
        (lambda: EngineConfig(flow_compile="yes"), "flow_compile"),  # type: ignore[arg-type]
        (lambda: EngineConfig(flow_aot="yes"), "flow_aot"),  # type: ignore[arg-type]
        (lambda: EngineConfig(flow_precompiled="yes"), "flow_precompiled"),  # type: ignore[arg-type]
        (lambda: EngineConfig(flow_voice_pages=None), "flow_voice_pages"),  # type: ignore[arg-type]
        (lambda: EngineConfig(lm_native_graphs=1), "lm_native_graphs"),  # type: ignore[arg-type]
        (lambda: EngineConfig(t2w_yield_to_urgent=None), "t2w_yield_to_urgent"),  # type: ignore[arg-type]
        (lambda: EngineConfig(t2w_quiet_first=None), "t2w_quiet_first"),  # type: ignore[arg-type]
        (lambda: EngineConfig(t2w_first_lane=1), "t2w_first_lane"),  # type: ignore[arg-type]
        (lambda: EngineConfig(t2w_lane_priority=None), "t2w_lane_priority"),  # type: ignore[arg-type]
        (lambda: EngineConfig(t2w_fifo=True, t2w_quiet_first=True), "t2w_quiet_first off"),
        (lambda: EngineConfig(first_graphs_early=True, background_graphs=False), "needs background_graphs"),
        (lambda: EngineConfig(lm_kv_cache_gib=0.0), "lm_kv_cache_gib"),
        (lambda: EngineConfig(ready_graph_wait_s=-1.0), "ready_graph_wait_s"),
        (lambda: EngineConfig(ready_graph_wait_s=float("nan")), "ready_graph_wait_s"),
        (lambda: EngineConfig(lm_kv_cache_gib=2048.0), "lm_kv_cache_gib"),
        (lambda: EngineConfig(prompt_cache_size=-1), "prompt_cache_size"),
        (lambda: EngineConfig(llm_variant="dpo"), "llm_variant"),
        (lambda: EngineConfig(cuda_mps=True, device="cpu"), "cuda_mps needs a CUDA device"),
        (lambda: EngineConfig(cuda_mps=True, device="npu"), "cuda_mps needs a CUDA device"),
        (lambda: EngineConfig(cuda_mps=False, mps_flow_percent=60), "mps_flow_percent needs cuda_mps"),
        (lambda: EngineConfig(cuda_mps=True, mps_flow_percent=0), "1-100"),
        (lambda: EngineConfig(cuda_mps=True, mps_flow_percent=101), "1-100"),
        (lambda: EngineConfig(cuda_mps=False, mps_flow_below_normal=True), "needs cuda_mps"),
        (lambda: StreamConfig(token_hop=0), "token_hop"),
        (lambda: Limits(max_prompt_s=40), "30"),
        (lambda: Limits(max_concurrency=0), "max_concurrency"),
        (lambda: SynthesisRequest(text="x", speed=3.0), "speed"),
        (lambda: SynthesisRequest(text="x", seed=-1), "seed"),
        (lambda: SynthesisRequest(text="x", mode="sing"), "sing"),
    ],
)
def test_bad_values_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_first_chunk_lane_opens_by_default_where_the_device_replays_graphs():
    """auto (None, the default): a second token2wav worker where graphs replay (a GPU, v3 and v2), not on
    the CPU, whose few cores the one worker already keeps busy; True and False as set."""
    auto = EngineConfig()
    assert auto.t2w_first_lane is None
    assert [auto.opens_first_lane(g) for g in (True, False)] == [True, False]
    for lane in (True, False):
        cfg = EngineConfig(t2w_first_lane=lane)
        assert all(cfg.opens_first_lane(g) is lane for g in (True, False))


def test_request_mode_accepts_strings():
    assert SynthesisRequest(text="x", mode="vc").mode is Mode.VC


def test_fast_start_auto_splits_while_lightly_loaded_and_explicit_choices_stay():
    assert StreamConfig().fast_start is None  # auto: faster first audio while few requests start at once
    auto = StreamConfig(fast_start=None, fast_start_burst_s=None)  # the rule by requests computing
    assert auto.fast_start_max_active == 4
    assert auto.splits_first_chunk(active=1) and auto.splits_first_chunk(4)
    assert not auto.splits_first_chunk(active=5)  # busy: the reference's thicker first chunk
    for explicit in (True, False):
        cfg = StreamConfig(fast_start=explicit)
        assert all(cfg.splits_first_chunk(a) is explicit for a in (1, 9))
    assert [fast_start_choice(c) for c in ("auto", "on", "off")] == [None, True, False]
    assert auto.splits_first_chunk(active=1, recent=9)  # recent starts count only with a burst


def test_fast_start_burst_rule_counts_recent_starts_and_stops_under_load():
    """With fast_start_burst_s, auto splits while few requests started within the window (a wave's first
    chunks coincide; earlier streams are past theirs) and the engine is below adaptive_min_active."""
    burst = StreamConfig(fast_start_busy=False)
    assert burst.fast_start_burst_s == 0.5  # the default: about a split first chunk's audio
    assert burst.splits_first_chunk(active=5, recent=1)  # old rule: 5 active, no split
    assert burst.splits_first_chunk(active=7, recent=4)
    assert not burst.splits_first_chunk(active=5, recent=5)  # a wave
    assert not burst.splits_first_chunk(active=8, recent=1)  # under load (adaptive hops)
    assert not burst.splits_first_chunk(active=5)  # without the count: the active rule
    busy = StreamConfig()  # the burst rule whatever the load (fast_start_busy, the default)
    assert busy.fast_start_busy and busy.splits_first_chunk(active=40, recent=4)
    assert not busy.splits_first_chunk(active=1, recent=5)  # a wave still is one
    with pytest.raises(ValueError, match="fast_start_busy"):
        StreamConfig(fast_start_busy=1)  # type: ignore[arg-type]
    for bad in (0.0, -1.0, 61.0):
        with pytest.raises(ValueError, match="fast_start_burst_s"):
            StreamConfig(fast_start_burst_s=bad)
    assert [fast_start_flag(fast_start_choice(c)) for c in FAST_START_CHOICES] == list(FAST_START_CHOICES)
    with pytest.raises(ValueError, match="fast start"):
        fast_start_choice("always")
    with pytest.raises(ValueError, match="fast_start"):
        StreamConfig(fast_start="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fast_start_max_active"):
        StreamConfig(fast_start_max_active=0)


def test_flow_compile_auto_compiles_v3_only_and_explicit_choices_stay():
    assert EngineConfig().compiles_flow("cosyvoice3") and not EngineConfig().compiles_flow("cosyvoice2")
    for explicit in (True, False):
        cfg = EngineConfig(flow_compile=explicit)
        assert cfg.compiles_flow("cosyvoice2") is explicit and cfg.compiles_flow("cosyvoice3") is explicit


def test_flow_reuse_auto_is_on_but_for_v2s_graphs():
    """Frame reuse is exact everywhere; auto turns it off only where it measured slower: v2's U-Net in CUDA
    graphs (H200, 2026-12-01). An explicit choice holds for every family and solver."""
    cases = [(f, g) for f in ("cosyvoice2", "cosyvoice3") for g in (False, True)]
    auto = {case: EngineConfig().reuses_flow(*case) for case in cases}
    assert auto == {case: case != ("cosyvoice2", True) for case in cases}
    for choice in (True, False):
        assert {EngineConfig(flow_reuse=choice).reuses_flow(*case) for case in cases} == {choice}
    with pytest.raises(ValueError, match="flow_reuse"):
        EngineConfig(flow_reuse="yes")  # type: ignore[arg-type]


def test_flow_attention_is_the_dense_mask_unless_folded_or_cudnn_is_asked():
    assert EngineConfig().flow_attention == "mask"
    assert EngineConfig(flow_attention="folded").flow_attention == "folded"
    assert EngineConfig(flow_attention="cudnn").flow_attention == "cudnn"
    with pytest.raises(ValueError, match="flow_attention"):
        EngineConfig(flow_attention="flex")


def test_speed_other_than_one_turns_streaming_off() -> None:
    assert SynthesisRequest(text="x", stream=True).streams_audio
    assert not SynthesisRequest(text="x", stream=True, speed=1.5).streams_audio
    assert not SynthesisRequest(text="x", stream=False).streams_audio


def test_the_shared_flags_parse_into_the_config_values() -> None:
    import argparse

    from engine.config import add_device_flags, add_fast_start_flag, add_model_flag

    p = argparse.ArgumentParser()
    add_model_flag(p)
    add_device_flags(p, "cpu", llm_variant=True)
    add_fast_start_flag(p)
    args = p.parse_args([])
    assert (args.model, args.device, args.backend, args.llm_variant) == (DEFAULT_MODEL, "cpu", "auto", "base")
    assert fast_start_choice(args.fast_start) is StreamConfig.fast_start
    args = p.parse_args(
        ["--device", "cuda", "--backend", "vllm", "--llm-variant", "rl", "--fast-start", "off"]
    )
    assert (args.device, args.backend, args.llm_variant, fast_start_choice(args.fast_start)) == (
        "cuda", "vllm", "rl", False,
    )  # fmt: skip
    with pytest.raises(SystemExit):
        p.parse_args(["--device", "tpu"])
    bare = argparse.ArgumentParser()
    add_device_flags(bare)
    assert not hasattr(bare.parse_args([]), "llm_variant")


def test_cuda_mps_is_auto_by_default_and_its_flags_turn_it_on_or_off() -> None:
    import argparse

    from engine.config import add_overlap_flags

    p = argparse.ArgumentParser()
    add_overlap_flags(p)
    assert p.parse_args([]).cuda_mps is EngineConfig.cuda_mps is None
    assert p.parse_args(["--no-cuda-mps"]).cuda_mps is False
    with pytest.raises(SystemExit):
        p.parse_args(["--cuda-mps", "--no-cuda-mps"])
    assert p.parse_args([]).mps_flow_percent is EngineConfig.mps_flow_percent is None
    assert EngineConfig(mps_flow_percent=60).mps_flow_percent == 60  # auto: the share where MPS runs
    assert p.parse_args([]).mps_flow_below_normal is EngineConfig.mps_flow_below_normal is False
    assert p.parse_args(["--mps-flow-below-normal"]).mps_flow_below_normal is True
    args = p.parse_args(["--cuda-mps", "--mps-flow-percent", "60"])
    assert args.cuda_mps is True and EngineConfig(cuda_mps=True, mps_flow_percent=60).mps_flow_percent == 60
    assert (
        EngineConfig(cuda_mps=True).device == "auto" and EngineConfig(cuda_mps=True, device="cuda").cuda_mps
    )


def test_the_lm_profile_dir_is_off_by_default_and_names_a_directory_when_set():
    from engine.config import EngineConfig

    assert EngineConfig(model="demo-tiny").lm_profile_dir is None
    assert EngineConfig(model="demo-tiny", lm_profile_dir="/tmp/lm").lm_profile_dir == "/tmp/lm"
    with pytest.raises(ValueError, match="lm_profile_dir"):
        EngineConfig(model="demo-tiny", lm_profile_dir="  ")
