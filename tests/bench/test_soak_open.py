"""bench/soak_open.py: a short open-loop soak of the tiny v3 model on the CPU through
``python -m bench.soak`` (leavers and bad requests mixed in), the verdict on each kind of violation, and the
drain of stuck requests."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import replace

import pytest

from bench import soak, soak_open
from bench.soak_mix import BAD, BAD_CASES, GOOD, LEAVER, VOICE, MixConfig, Outcome, schedule
from engine.demo.make_model import build_model_dir

MIX = {"rate": 3.0, "minutes": 0.1, "tokens": 50, "leave_fraction": 0.3, "bad_fraction": 0.3, "seed": 5}


def test_cli_open_loop_soak_serves_the_good_refuses_the_bad_and_frees_the_leavers(tmp_path):
    model = build_model_dir(tmp_path / "model", "cosyvoice3", "tiny")
    out = tmp_path / "soak"
    argv = ["--model", str(model), "--device", "cpu", "--backend", "native", "--arrivals", "poisson"]
    argv += ["--rate", "3", "--minutes", "0.1", "--tokens", "50", "--leave-fraction", "0.3"]
    argv += ["--bad-fraction", "0.3", "--voice-fraction", "0.3", "--seed", "5", "--slots", "8"]
    rc = soak.main([*argv, "--sample-s", "1", "--window-s", "3", "--checkpoint-s", "2", "--out", str(out)])
    data = json.loads((out / "soak.json").read_text())
    partial = json.loads((out / "soak.partial.json").read_text())  # the last checkpoint, before the end
    assert partial["summary"]["partial"] and partial["voices"] is None
    assert 0 < len(partial["outcomes"]) <= len(data["outcomes"]) and partial["samples"]
    s = data["summary"]
    sent = schedule(MixConfig(**MIX, voice_fraction=0.3))
    kinds = Counter(a.kind for a in sent)
    assert s["requests"] == len(sent) == 18 and s["kinds"] == dict(kinds)
    assert s["good_failed"] == 0 and s["refused"] == 0 and s["stuck"] == 0, s["good_errors"]
    assert s["admitted"] == s["good_requests"] == kinds[GOOD] + kinds[VOICE] + kinds[LEAVER]
    cases = Counter(a.case for a in sent if a.kind == BAD)
    for case in BAD_CASES:
        bad = s["bad"][case.name]
        assert bad["sent"] == bad["as_expected"] == cases[case.name] and bad["wrong"] == 0, bad
        assert all(e.startswith(case.expected.__name__) for e in bad["errors"])
    leavers = s["leavers"]
    assert leavers["sent"] == kinds[LEAVER] and leavers["left"] >= 1
    assert leavers["left"] == leavers["freed"] == leavers["engine_cancelled"]
    assert s["voices"] == {"saved": 3, "listed": 3, "intact": 3, "ok": True}
    assert (s["end_state"]["active"], s["end_state"]["queued"]) == (0, 0)
    windows = s["ttfa_windows"]
    last = max(o["start_s"] for o in data["outcomes"])
    assert [w["from_s"] for w in windows] == [3.0 * k for k in range(max(2, int(last // 3) + 1))]
    assert sum(w["requests"] for w in windows) == sum(o["ttfa_ms"] is not None for o in data["outcomes"])
    # a loaded CPU may underrun, and RSS still climbs from its warm-up in seconds; nothing else may fail
    why = soak_open.violations(s)
    assert rc == (1 if why else 0) and all(v.endswith(("underran", "rss_mb not flat")) for v in why), why
    report = (out / "soak.md").read_text()
    assert "# Open-loop soak: 3 requests/s for 0.1 min" in report and "| unknown voice |" in report
    (out / "soak.md").unlink()  # --rescore rebuilds the report from soak.json alone
    assert soak.main(["--rescore", "--out", str(out)]) == rc
    assert json.loads((out / "soak.json").read_text())["summary"] == s
    assert (out / "soak.md").read_text() == report


def outcome(kind: str = GOOD, **kw) -> Outcome:
    base = Outcome(0, kind, "", 1.0, 50, 120.0, 2.0, 0)
    return replace(base, **kw)


def clean_run() -> soak_open.OpenSoakRun:
    cfg = soak_open.OpenSoakConfig(MixConfig(rate=1.0, minutes=1.0), window_s=30.0)
    samples = [soak.Sample(t, 1000.0, 500.0, 600.0, 0, 0, 0, 0, 1000) for t in range(0, 61, 10)]
    outs = [
        outcome(start_s=5.0, ttfa_ms=100.0),
        outcome(VOICE, start_s=40.0, ttfa_ms=300.0),
        outcome(LEAVER, freed=True, audio_s=0.8),
        outcome(
            BAD, case="empty text", ttfa_ms=None, audio_s=0.0, error="InvalidInput: empty", as_expected=True
        ),
    ]
    return soak_open.OpenSoakRun(cfg, samples, outs, 61.0, cancelled=1, voices=soak_open.VoiceCheck(3, 3, 3))


def test_a_clean_run_passes_and_reports_ttfa_per_window():
    summary = soak_open.summarize(clean_run())
    assert soak_open.violations(summary) == []
    assert [(w["requests"], w["p50"]) for w in summary["ttfa_windows"]] == [(2, 110.0), (1, 300.0)]
    assert summary["bad"]["empty text"] == {
        "expected": "InvalidInput", "sent": 1, "as_expected": 1, "refused": 0, "wrong": 0,
        "errors": ["InvalidInput: empty"],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda r: r.outcomes.append(outcome(error="SynthesisFailed: boom")), "1 good requests failed"),
        (lambda r: r.outcomes.append(outcome(underruns=2)), "1 admitted streams underran"),
        (lambda r: r.outcomes.append(outcome(BAD, case="bad speed", as_expected=False)), "bad 'bad speed'"),
        (lambda r: r.outcomes.append(outcome(LEAVER, freed=False)), "leavers: 2 left, 1 freed"),
        (lambda r: setattr(r, "cancelled", 0), "the engine cancelled 0"),
        (lambda r: setattr(r, "stuck", 2), "2 stuck"),
        (lambda r: setattr(r, "voices", soak_open.VoiceCheck(3, 3, 2)), "voices store not intact"),
        (
            lambda r: setattr(r, "outcomes", [o for o in r.outcomes if o.kind == BAD]),
            "no request was admitted",
        ),
    ],
    ids=["failed", "underrun", "bad served", "leaver held", "not cancelled", "stuck", "voices", "none"],
)
def test_each_violation_fails_the_run(change, why):
    run = clean_run()
    change(run)
    found = soak_open.violations(soak_open.summarize(run))
    assert any(why in v for v in found), found


def test_refused_requests_are_counted_apart_from_failures():
    run = clean_run()
    run.outcomes.append(outcome(error="Busy: the server is at capacity", refused=True, ttfa_ms=None))
    summary = soak_open.summarize(run)
    assert (summary["refused"], summary["good_failed"]) == (1, 0) and soak_open.violations(summary) == []


def test_growing_device_memory_fails_the_run():
    run = clean_run()
    run.samples = [replace(s, device_mb=500.0 + s.t_s * 5) for s in run.samples]  # 300 MiB/min
    assert "device_mb not flat" in soak_open.violations(soak_open.summarize(run))


async def test_drain_cancels_and_counts_what_is_still_running():
    stuck = asyncio.create_task(asyncio.Event().wait())  # never set: a request that hangs
    finishing = asyncio.create_task(asyncio.sleep(0))
    assert await soak_open.drain({stuck, finishing}, ceiling_s=0.5) == 1
    assert stuck.cancelled() and finishing.done() and not finishing.cancelled()
    assert await soak_open.drain(set(), ceiling_s=0.5) == 0


async def test_checkpoints_hand_over_the_run_so_far_until_stopped():
    run, stop, seen = clean_run(), asyncio.Event(), []

    def save(r: soak_open.OpenSoakRun) -> None:
        seen.append(r.duration_s)
        if len(seen) == 3:
            stop.set()

    t0 = time.monotonic()
    await asyncio.wait_for(soak_open.checkpoints(run, t0 - 100.0, 0.01, stop, save), 5.0)
    assert len(seen) == 3 and all(d > 0 for d in seen)  # duration so far, set before each save
    stop_early = asyncio.Event()
    stop_early.set()
    await soak_open.checkpoints(run, t0, 0.01, stop_early, save)
    assert len(seen) == 3  # nothing saved once stopped


def test_open_config_is_checked():
    mix = MixConfig(rate=1.0, minutes=1.0)
    with pytest.raises(ValueError, match="slots and voices"):
        soak_open.OpenSoakConfig(mix, slots=0)
    with pytest.raises(ValueError, match="must be > 0"):
        soak_open.OpenSoakConfig(mix, window_s=0)
    with pytest.raises(ValueError, match="checkpoint_s must be > 0"):
        soak_open.OpenSoakConfig(mix, checkpoint_s=0)


def test_poisson_needs_a_rate():
    with pytest.raises(SystemExit):
        soak.parse_args(["--arrivals", "poisson", "--out", "x"])


def test_ttfa_windows_reach_the_last_arrival():
    """Poisson arrivals may run past the nominal minutes: their requests get a window of their own."""
    outs = [outcome(start_s=10.0, ttfa_ms=100.0), outcome(start_s=61.5, ttfa_ms=400.0)]
    rows = soak_open.ttfa_windows(outs, 30.0, 60.0)
    assert [(w["from_s"], w["requests"], w["p95"]) for w in rows] == [
        (0.0, 1, 100.0),
        (30.0, 0, None),
        (60.0, 1, 400.0),
    ]


def test_each_window_counts_the_streams_that_underran():
    """Where the underruns were (a bad start after ready, or a drift) shows in the window they were sent."""
    outs = [outcome(start_s=1.0, underruns=3), outcome(start_s=2.0), outcome(start_s=40.0, underruns=1)]
    rows = soak_open.ttfa_windows(outs, 30.0, 60.0)
    assert [w["underrun"] for w in rows] == [1, 1]
    table = soak_open._windows({"ttfa_windows": rows})
    assert table[2].endswith("| 1 |") and "underrun streams" in table[0]
