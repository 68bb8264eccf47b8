"""bench.trace: the per-chunk trace of an open-loop run (engine -> trace.jsonl) and its summary."""

from __future__ import annotations

import gzip
import itertools
import json

import pytest

from bench.__main__ import main as bench_main
from bench.load import percentile
from bench.trace import behind_spare, main, on_one_clock, read, seam_sent, summarise


def row(request: int, index: int, ready: float, joined: float, vocoded: float, sent: float, slack: float,
        batch: int = 2, frames: int = 150, bucket: int = 200) -> dict[str, object]:  # fmt: skip
    return {
        "mode": "stream open-loop", "rate": 4.0, "request": request, "index": index, "first": index == 0,
        "ready_ms": ready, "joined_ms": joined, "flow_done_ms": (joined + vocoded) / 2, "vocoded_ms": vocoded,
        "sent_ms": sent, "slack_ms": slack, "batch": batch, "frames": frames, "bucket_frames": bucket,
        "deadline_ms": sent + slack,
    }  # fmt: skip


def test_summary_splits_first_chunks_from_later_ones_and_counts_misses_and_padding():
    rows = [
        row(0, 0, ready=100, joined=110, vocoded=150, sent=151, slack=-51),
        row(0, 1, ready=400, joined=600, vocoded=700, sent=701, slack=-20),  # waited 200 ms, missed
        row(1, 0, ready=200, joined=240, vocoded=300, sent=300, slack=-100),
        row(1, 1, ready=500, joined=505, vocoded=540, sent=541, slack=900, frames=200),
    ]
    (s,) = summarise(rows)
    assert (s.requests, s.chunks, s.later, s.later_missed) == (2, 4, 2, 1)
    assert s.first_lm == 150 and s.first_wait == 25 and s.first_compute == 50
    assert s.first_sent_p50 == pytest.approx(225.5)
    # without their waits for the worker (10 and 40 ms) the first chunks would have gone at 141 and 260 ms
    assert s.first_unwaited_p95 == pytest.approx(percentile([141, 260], 95))
    assert s.first_unwaited_p95 < s.first_sent_p95
    assert s.missed_wait == 200 and s.missed_compute == 100
    assert s.padding_share == pytest.approx(150 / 800)  # 50 padded frames in 3 of 4 rows of 200
    assert s.hand_off == pytest.approx(0.75)
    assert "1 of 2 missed their deadline (50.0 %)" in "\n".join(s.lines())
    assert s.first_on_lane == 0  # rows from before the lane name none
    rows[2]["lane"] = "first"
    (s,) = summarise(rows)
    assert s.first_on_lane == 1 and "1 of 2 ran on the first-chunk lane" in "\n".join(s.lines())
    assert s.first_by_tokens == () and "by length" not in "\n".join(s.lines())  # rows without tokens


def test_first_chunks_are_told_apart_by_length():
    """The fast start's split first chunks (16 tokens) and the reference's (41): how many, and when sent."""
    rows = [
        row(i, 0, ready=50, joined=60, vocoded=100 + 10 * i, sent=100 + 10 * i, slack=-1) for i in range(3)
    ]
    rows += [row(3 + i, 0, ready=150, joined=160, vocoded=250 + i, sent=250 + i, slack=-1) for i in range(2)]
    for r, tokens in zip(rows, [16, 16, 16, 41, 41]):
        r["tokens"] = tokens
    (s,) = summarise(rows)
    assert [(g.tokens, g.count) for g in s.first_by_tokens] == [(16, 3), (41, 2)]
    assert s.first_by_tokens[0].sent_p50 == pytest.approx(percentile([100, 110, 120], 50))
    assert s.first_by_tokens[1].sent_p95 == pytest.approx(percentile([250, 251], 95))
    assert s.first_by_tokens[0].computing_p50 is None  # traces from before the load was recorded
    line = "\n".join(s.lines())
    assert "first chunks by length: 16 tokens: 3, sent p50 110 / p95" in line and "41 tokens: 2" in line
    assert "at their start" not in line
    # the load as each request started: the 41-token ones came among more requests computing
    for r, computing, recent in zip(rows, [1, 2, 3, 9, 11], [1, 2, 2, 1, 6]):
        r["computing_at_start"], r["recent_starts"] = computing, recent
    (s,) = summarise(rows)
    split, whole = s.first_by_tokens
    assert (split.computing_p50, split.computing_max) == (2, 3)
    assert (whole.computing_p50, whole.computing_max) == (10, 11)
    assert whole.recent_p50 == pytest.approx(3.5)
    line = "\n".join(s.lines())
    assert "41 tokens: 2, sent p50 250 / p95 251 ms (at their start: computing p50 10, max 11, started" in (
        line
    )


def test_first_chunks_of_many_lengths_print_as_two_bands_split_and_the_references():
    """Prompts of many lengths (bench --prompt-spread) give as many first-chunk lengths: more than four
    print as two bands, the split ones (shorter than a chunk and the look-ahead: 28 tokens) and the
    reference's, each with its range."""
    lengths = [15, 16, 20, 27, 28, 33, 39]
    rows = [
        row(i, 0, ready=100, joined=110, vocoded=100 + t, sent=100 + t, slack=-1)
        for i, t in enumerate(lengths)
    ]
    for r, tokens in zip(rows, lengths):
        r["tokens"] = tokens
    (s,) = summarise(rows)
    split, reference = s.first_by_tokens
    assert (split.band, split.tokens, split.top, split.count) == ("split", 15, 27, 4)
    assert (reference.band, reference.tokens, reference.top, reference.count) == ("reference", 28, 39, 3)
    assert reference.sent_p50 == pytest.approx(133)
    line = "\n".join(s.lines())
    assert (
        "first chunks by length: split, 15-27 tokens: 4, sent p50" in line
        and "; reference, 28-39 tokens: 3" in line
    )


def test_the_lms_first_chunk_pace_is_told_by_the_load_its_requests_started_in():
    """The first token and the ms a later token per band of requests computing: alone, beside 2-4, 5-9,
    10 or more; bands with no first chunk are left out, and rows without a first token give no line."""
    # (tokens ready ms, first token ms, tokens, requests computing at the start)
    firsts = [(40, 16, 17, 1), (60, 20, 21, 1), (300, 50, 26, 12), (130, 40, 31, 3)]
    rows = [row(i, 0, ready=ready, joined=ready, vocoded=ready + 50, sent=ready + 50, slack=-1)
            for i, (ready, *_) in enumerate(firsts)]  # fmt: skip
    for r, (_, _, tokens, computing) in zip(rows, firsts):
        r["tokens"], r["computing_at_start"] = tokens, computing
    later = row(9, 1, ready=500, joined=500, vocoded=550, sent=550, slack=100)  # a later chunk: not timed
    rows.append(later)
    (s,) = summarise(rows)
    assert s.lm_by_load == () and "by load" not in "\n".join(s.lines())  # no first token recorded
    for r, (_, first_token, _, _) in zip(rows, firsts):
        r["lm_first_token_ms"] = first_token
    (s,) = summarise(rows)
    alone, few, many = s.lm_by_load
    assert [(p.low, p.high, p.count) for p in s.lm_by_load] == [(1, 1, 2), (2, 4, 1), (10, None, 1)]
    assert alone.first_token_p50 == pytest.approx(percentile([16, 20], 50))
    # (40 - 16) / 16 and (60 - 20) / 20 ms a token alone; (300 - 50) / 25 beside 11 others
    assert alone.per_token_p50 == pytest.approx(percentile([1.5, 2.0], 50))
    assert (few.per_token_p50, many.per_token_p50) == (pytest.approx(3.0), pytest.approx(10.0))
    line = next(x for x in s.lines() if "by load" in x)
    assert "1 computing: 2, first token 18 + 1.8 ms a token; 2-4 computing: 1, first token 40 + 3.0" in line
    assert "10+ computing: 1, first token 50 + 10.0 ms a token" in line and "5-9" not in line


def test_first_chunks_after_a_kept_voices_pages_are_told_from_those_computed_from_frame_0():
    """EngineConfig.flow_voice_pages: first chunks whose cache began with a kept voice's prompt frames
    (``cached_frames``) against the others; no line where none did (the feature off, or older traces)."""
    rows = [row(i, 0, ready=100, joined=100, vocoded=100 + 2 * f, sent=100 + 2 * f + 5, slack=-1)
            for i, f in enumerate([40, 50, 60, 20, 30])]  # fmt: skip  # flow: half of joined -> vocoded
    (s,) = summarise(rows)
    assert s.first_starts == () and "kept voice" not in "\n".join(s.lines())
    for r, cached in zip(rows, [0, 0, 0, 150, 200]):
        r["cached_frames"] = cached
    (s,) = summarise(rows)
    kept, fresh = s.first_starts
    assert (kept.kept, kept.count, fresh.kept, fresh.count) == (True, 2, False, 3)
    assert kept.flow_p50 == pytest.approx(25) and fresh.flow_p50 == pytest.approx(50)
    assert kept.sent_p50 == pytest.approx(155) and fresh.sent_p50 == pytest.approx(205)
    line = next(x for x in s.lines() if "kept voice" in x)
    assert "after a kept voice's prompt pages: 2, flow p50 25, sent p50 155 ms; from frame 0: 3" in line


def test_summary_keeps_the_arms_of_one_run_apart():
    arm = {"system": "cosystream relaxed-cap"}
    rows = [row(0, 0, 100, 110, 150, 151, -51), row(1, 0, 100, 110, 150, 151, -51) | arm]
    assert sorted(s.system for s in summarise(rows)) == ["", "cosystream relaxed-cap"]


def seam_rows(first_ready_ms: float, deadline_ms: float) -> list[dict[str, object]]:
    """On the run's clock (1 request/s, seed 0): request 0's later chunk runs 1000-1130 ms (its flow ends at
    1050, its audio is due at ``deadline_ms``); request 1's first chunk is ready at ``first_ready_ms``,
    waits for that call and runs 1130-1175 ms."""
    import random

    from bench.open_loop import OpenLoop

    sent_1 = 1000.0 * OpenLoop(1.0, 2).arrivals(random.Random(0))[1]

    def on(ms: float, sent: float) -> float:  # the run's clock -> ms after that request's submit
        return ms - sent

    later = row(0, 1, ready=1000, joined=1000, vocoded=1130, sent=1130, slack=deadline_ms - 1130) | {
        "rate": 1.0, "flow_done_ms": 1050.0
    }  # fmt: skip
    first = row(1, 0, on(first_ready_ms, sent_1), on(1130, sent_1), on(1175, sent_1), on(1176, sent_1), 0)
    return [later, first | {"rate": 1.0, "flow_done_ms": on(1160, sent_1)}]


def on_clock(rows: list[dict[str, object]]) -> tuple[list[dict[str, object]], dict[str, list[float]]]:
    return rows, on_one_clock(rows)  # type: ignore[arg-type]


def test_the_seam_replay_lets_a_first_chunk_wait_only_for_the_running_flow_when_the_call_can_spare_it():
    (sent,) = seam_sent(*on_clock(seam_rows(first_ready_ms=1020, deadline_ms=5000)))
    (as_run,) = [r["sent_ms"] for r in seam_rows(1020, 5000) if r["first"]]
    assert sent == pytest.approx(as_run - 80)  # waited 110 ms (1020 -> 1130); at the seam 30 (-> 1050)
    (shut,) = seam_sent(*on_clock(seam_rows(first_ready_ms=1020, deadline_ms=2500)))  # 1.45 s to spare
    (late,) = seam_sent(*on_clock(seam_rows(first_ready_ms=1060, deadline_ms=5000)))  # ready after the flow
    assert shut == pytest.approx(as_run) and late == pytest.approx(as_run)  # as run: sent at 1176 ms


def test_a_first_chunk_behind_a_call_of_rows_with_seconds_to_spare_is_counted_as_such():
    assert behind_spare(*on_clock(seam_rows(first_ready_ms=1020, deadline_ms=5000))) == (1, 1)
    assert behind_spare(*on_clock(seam_rows(first_ready_ms=1020, deadline_ms=2500))) == (1, 0)  # 1.48 s


def test_a_gzipped_trace_reads_like_the_plain_one(tmp_path):
    rows = [row(0, 0, 100, 110, 150, 151, -51), row(0, 1, 400, 600, 700, 701, -20)]
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    (tmp_path / "trace.jsonl").write_text(text)
    (tmp_path / "trace.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    assert read(tmp_path / "trace.jsonl.gz") == read(tmp_path / "trace.jsonl") == rows


def test_open_loop_trace_on_the_tiny_v3_model_times_every_chunk_in_order(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--random-tiny", "v3", "--cache-dir", str(tmp_path / "cache"), "--concurrency", "4"]
    argv += [
        "--arrivals",
        "poisson",
        "--rate",
        "4",
        "--requests",
        "3",
        "--duration-s",
        "0.1",
        "--seeds",
        "0",
        "--tokens",
        "40",
    ]
    paths = bench_main([*argv, "--modes", "stream", "--warmup", "0", "--trace", "--out", str(out)])
    rows = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    result = json.loads(paths["json"].read_text())
    (level,) = result["levels"]
    assert all("trace" not in r for r in level["per_request"])  # the traces live in trace.jsonl only
    assert {r["request"] for r in rows} == {0, 1, 2}
    for req in level["per_request"]:
        mine = [r for r in rows if r["request"] == req["index"]]
        assert [r["index"] for r in mine] == list(range(req["chunks"]))
        assert sum(r["audio_s"] for r in mine) == pytest.approx(req["audio_s"])
        assert mine[0]["first"] and mine[0]["sent_ms"] <= req["ttfa_ms"] + 1.0
    for r in rows:
        assert r["ready_ms"] <= r["joined_ms"] <= r["flow_done_ms"] <= r["vocoded_ms"] <= r["sent_ms"]
        assert r["batch"] >= 1 and r["bucket_frames"] >= r["frames"] > 0
        assert r["lm_first_token_ms"] <= r["ready_ms"]
        assert r["slack_ms"] == pytest.approx(r["deadline_ms"] - r["sent_ms"])
    (summary,) = main([str(out / "trace.jsonl")])
    assert summary.chunks == len(rows) and summary.requests == 3
    assert "stream open-loop [cosystream] at 4.0 requests/s, seed 0: 3 requests" in capsys.readouterr().out


def test_trace_needs_the_open_loop():
    with pytest.raises(SystemExit):
        bench_main(["--random-tiny", "v3", "--trace"])


def test_the_lms_first_token_is_told_by_how_much_of_the_main_workers_call_was_left_at_submit():
    """A request sent while a main-worker call runs queues its prompt's device work behind that call (the
    default stream): first tokens by the longest such call's ms left, and with none running. The first-chunk
    lane's calls (its own stream) do not count; rows without a first token give no line."""
    import random

    from bench.open_loop import OpenLoop

    sends = [1000.0 * t for t in OpenLoop(4.0, 4).arrivals(random.Random(0))]
    assert all(b - a > 60 for a, b in itertools.pairwise(sends))  # room for the calls placed below

    def call(i: int, index: int, start: float, end: float, lane: str) -> dict[str, object]:
        """Request ``i``'s chunk computed from ``start`` to ``end`` ms on the run's clock."""
        a, b = start - sends[i], end - sends[i]
        return row(i, index, ready=a, joined=a, vocoded=b, sent=b, slack=500 if index else -1) | {
            "lane": lane
        }

    def first(i: int, first_token: float, lane: str = "main", end: float = 6.0) -> dict[str, object]:
        return call(i, 0, sends[i] + 5, sends[i] + end, lane) | {"lm_first_token_ms": first_token}

    rows = [
        first(0, 20.0),  # none running
        call(0, 1, sends[1] - 10, sends[1] + 30, "main"),  # request 1 is sent with 30 ms of it left
        first(1, 50.0, lane="first", end=sends[2] + 50 - sends[1]),  # the lane's, over request 2's send
        first(2, 22.0),  # which the lane's call does not hold up
        call(2, 1, sends[3] - 20, sends[3] + 10, "main"),  # 10 ms left at request 3's send
        call(1, 1, sends[3] - 30, sends[3] + 45, "main"),  # and 45: the longer counts
        first(3, 70.0),
    ]
    (s,) = summarise(rows)
    assert [(b.low, b.high, b.count, b.first_token_p50) for b in s.behind_call] == [
        (None, None, 2, pytest.approx(percentile([20.0, 22.0], 50))),
        (20.0, 40.0, 1, 50.0),
        (40.0, None, 1, 70.0),
    ]
    line = next(x for x in s.lines() if "main worker's call at submit" in x)
    assert "none running: 2, first token p50 21; 20-40 ms left: 1, first token p50 50; 40+ ms left: 1" in line
    for r in rows:
        r.pop("lm_first_token_ms", None)
    (s,) = summarise(rows)
    assert s.behind_call == () and "at submit" not in "\n".join(s.lines())


def test_the_first_token_is_told_in_parts_at_the_median_and_for_the_slowest_first_chunks():
    """The frontend, the prompt embeddings and the LM (p50s over every first chunk; means over the latest
    sent 5 %, at least one); rows from before the parts were recorded give no line."""
    rows = [row(i, 0, ready=100, joined=100, vocoded=150, sent=150 + i, slack=-1) for i in range(20)]
    (s,) = summarise(rows)
    assert s.token_parts == () and "in parts" not in "\n".join(s.lines())
    for i, r in enumerate(rows):  # the last one sent: a slow frontend and a slow LM
        slow = i == 19
        r |= {
            "frontend_ms": 40.0 if slow else 8.0 + i % 3,
            "prefix_ms": (40.0 if slow else 8.0 + i % 3) + 2.0,
        }
        r["lm_first_token_ms"] = r["prefix_ms"] + (150.0 if slow else 20.0)
    (s,) = summarise(rows)
    every, slowest = s.token_parts
    assert (every.count, every.frontend, every.embeddings, every.lm) == (20, pytest.approx(9.0), 2.0, 20.0)
    assert (slowest.count, slowest.frontend, slowest.embeddings, slowest.lm) == (1, 40.0, 2.0, 150.0)
    line = next(x for x in s.lines() if "in parts" in x)
    assert "all (20, p50s): frontend 9 + embeddings 2 + LM 20 ms; slowest 5 % (1, means): frontend 40" in line
    for i, r in enumerate(rows):  # the flow's prompt recorded: its span comes out of the embeddings'
        r["flow_prompt_ms"] = r["frontend_ms"] + (1.5 if i == 19 else 0.5)
    (s,) = summarise(rows)
    every, slowest = s.token_parts
    spans = (every.flow_prompt, every.embeddings, slowest.flow_prompt, slowest.embeddings)
    assert spans == (0.5, 1.5, 1.5, 0.5)
    line = next(x for x in s.lines() if "in parts" in x)
    assert "all (20, p50s): frontend 9 + flow prompt 0 + embeddings 2 + LM 20 ms" in line
