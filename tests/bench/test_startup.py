"""bench.startup: one server start timed end to end, against a stand-in server (a tiny HTTP process that
answers /health at once, /ready after a while with a timeline whose background phase ends later, and
answers /v1/audio/speech with SSE events: the audio, then metrics with TTFA parts)."""

from __future__ import annotations

import itertools
import json
import logging
import signal
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from bench.startup import Server, StartupRun, main, parse_args

SERVER = textwrap.dedent(
    """
    import base64, json, signal, sys, time, traceback
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    t0 = time.monotonic()
    # as python app.py does: the stacks into the log on SIGUSR1
    signal.signal(signal.SIGUSR1, lambda n, f: print("stack dump:", "".join(traceback.format_stack(f)),
                                                      file=sys.stderr, flush=True))
    READY_S, FULL_S = 0.5, float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    VOICES = set()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: one handler per connection, for all of its requests

        def log_message(self, *args):
            pass

        def reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.probes = getattr(self, "probes", 0) + 1
            now = time.monotonic() - t0
            if self.path == "/health":
                return self.reply(200, {"status": "ok"})
            if now < READY_S:
                return self.reply(503, {"error": "loading"})
            phases = [{"name": "weights", "start_s": 0.0, "seconds": 0.2, "background": False}]
            pending = ["flow solver graphs"] if now < FULL_S else []
            # as app.py with an LM handover: the native loop serves while vLLM starts
            stage, lm = ("warming", "native") if pending else ("steady", "vllm")
            self.reply(200, {"status": "ready", "stage": stage, "lm_backend": lm,
                             "startup": {"ready_s": READY_S, "phases": phases, "pending": pending}})

        def do_POST(self):
            print(f"POST on a connection that answered {getattr(self, 'probes', 0)} GETs", flush=True)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["stream_format"] == "sse", body  # the bench asks for events: TTFA parts come last
            audio = base64.b64encode(bytes(2 * 2400)).decode()
            lm_ms = 40.0 + 1000 * (time.monotonic() - t0)
            # as the engine's prompt cache: a voice seen before costs its frontend nothing
            frontend = 0.0 if body["ref_audio"] in VOICES else 2.0
            VOICES.add(body["ref_audio"])
            parts = {"queue": 0.5, "frontend": frontend, "lm": lm_ms, "t2w_wait": 1.0}
            events = [{"type": "speech.audio.delta", "audio": audio},
                      {"type": "speech.audio.done", "metrics": {"ttfa_parts_ms": parts, "stage_ms": {}}}]
            data = "".join(f"data: {json.dumps(e)}\\n\\n" for e in events).encode()
            self.send_response(200)
            self.send_header("X-Sample-Rate", "24000")
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_start_is_timed_from_launch_to_full_speed(tmp_path: Path, capsys, caplog) -> None:
    caplog.set_level(logging.INFO, logger="bench.startup")
    script, port, out = tmp_path / "server.py", free_port(), tmp_path / "run"
    script.write_text(SERVER)
    argv = ["--family", "cosyvoice3", "--cache-kind", "warm", "--out", str(out), "--port", str(port),
            "--hardware", "test", "--commit", "abc1234", "--limit-s", "120",
            "--", sys.executable, str(script), str(port)]  # fmt: skip
    assert main(argv) == 0
    run = json.loads((out / "startup.json").read_text())
    assert run["family"] == "cosyvoice3" and run["cache"] == "warm" and run["commit"] == "abc1234"
    assert run["hardware"] == "test" and run["finished"].endswith("+00:00") and run["error"] is None
    health, ready, full = run["launch_to_health_s"], run["launch_to_ready_s"], run["launch_to_full_speed_s"]
    assert 0 < health <= ready <= full and ready >= 0.5 and full >= 1.0
    assert len(run["first_ttfa_ms"]) == len(run["steady_ttfa_ms"]) == 5
    # each request's TTFA parts as the server sent them in its last event (lm: grows with the server's age)
    first, steady = run["first_ttfa_parts_ms"], run["steady_ttfa_parts_ms"]
    assert len(first) == len(steady) == 5 and first[0]["t2w_wait"] == 1.0
    # every request clones a voice of its own, so none hits the prompt cache: the steady requests pay the
    # prompt's features as the first do (with one voice for all, only the very first paid them)
    assert [p["frontend"] for p in first + steady] == [2.0] * 10
    served = first + steady
    assert all(a["lm"] < b["lm"] for a, b in itertools.pairwise(served))
    assert run["phases"][0]["name"] == "weights" and run["first_vs_steady"] > 0
    assert run["pending_during_first"] == ["flow solver graphs"]  # the first requests met the background
    assert (run["stage_at_ready"], run["lm_backend_at_ready"], run["lm_backend_at_full_speed"]) == (
        "warming", "native", "vllm",
    )  # fmt: skip
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # the line run.sh shows
    # each request in the log as it ended (first: seeds 0-4, steady: 100-104), so a cut run keeps them
    ended = [r.getMessage() for r in caplog.records if "the server's parts" in r.getMessage()]
    seeds = [*range(5), *range(100, 105)]
    assert [m.split(":")[0] for m in ended] == [f"request {i}" for i in seeds]
    assert summary["first_ttfa_ms"] == run["first_ttfa_ms"] and "first_ttfa_parts_ms" not in summary
    # the requests share the probes' connection: the first one's TTFA holds no first connection or set-up
    posts = [line for line in (out / "server.log").read_text().splitlines() if line.startswith("POST on")]
    assert len(posts) == 10 and all(int(line.split()[-2]) > 0 for line in posts), posts


def test_a_start_stopped_before_full_speed_keeps_ready_the_first_requests_and_the_timeline(tmp_path: Path):
    """A cold start whose background work outlasts the run's bound (the DiT's compile): ready and the
    first requests are recorded, and the timeline as far as it got."""
    script, port, out = tmp_path / "server.py", free_port(), tmp_path / "run"
    script.write_text(SERVER)
    argv = ["--family", "cosyvoice3", "--cache-kind", "cold", "--out", str(out), "--port", str(port),
            "--hardware", "test", "--commit", "abc1234", "--limit-s", "10",
            "--", sys.executable, str(script), str(port), "600"]  # fmt: skip
    assert main(argv) == 1
    run = json.loads((out / "startup.json").read_text())
    assert run["cache"] == "cold" and run["launch_to_ready_s"] >= 0.5
    assert run["launch_to_full_speed_s"] is None
    assert len(run["first_ttfa_ms"]) == 5 and run["steady_ttfa_ms"] == [] and run["first_vs_steady"] is None
    assert run["pending_during_first"] == ["flow solver graphs"] and "/ready" in run["error"]
    assert [p["name"] for p in run["phases"]] == ["weights"]


def test_a_server_that_dies_is_recorded_with_how_far_it_got(tmp_path: Path) -> None:
    argv = ["--family", "cosyvoice2", "--cache-kind", "cold", "--out", str(tmp_path), "--limit-s", "60",
            "--port", str(free_port()), "--", sys.executable, "-c", "raise SystemExit(3)"]  # fmt: skip
    assert main(argv) == 1
    run = json.loads((tmp_path / "startup.json").read_text())
    assert run["launch_to_health_s"] is None and "exited (rc 3)" in run["error"]


def test_a_server_launched_from_a_background_job_takes_its_sigint(tmp_path: Path, monkeypatch) -> None:
    """A shell starts a background job (the whole suite, a long bench run: ``cmd &``) with SIGINT ignored,
    which children inherit: the server is launched with SIGINT at its default, so stop()'s SIGINT ends it
    (rc -SIGINT), not a kill after the wait (in the suite run in the background this file's three stand-in
    servers waited 60 s each for it)."""
    monkeypatch.setattr("bench.startup.STOP_WAIT_S", 10.0)  # a failure waits 10 s, not 60
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    inherited = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job starts
    try:
        server = Server(command, "http://127.0.0.1:1", tmp_path / "server.log")
    finally:
        signal.signal(signal.SIGINT, inherited)
    server.stop()
    assert server.proc.returncode == -signal.SIGINT


def test_the_record_checks_its_kind_and_the_command_is_required() -> None:
    with pytest.raises(ValueError):
        StartupRun("cosyvoice4", "cold", None, None, None, "x", "t", "c", [], 250)
    with pytest.raises(SystemExit):
        parse_args(["--family", "cosyvoice3", "--cache-kind", "cold", "--out", "x"])


def test_stack_dumps_reach_the_servers_log_while_the_first_requests_run(tmp_path: Path) -> None:
    """``--stack-dumps-at 0``: SIGUSR1 right after ready; the server (which dumps on it, as app.py does)
    writes its threads' stacks into server.log and serves on."""
    script, port, out = tmp_path / "server.py", free_port(), tmp_path / "run"
    script.write_text(SERVER)
    argv = ["--family", "cosyvoice2", "--cache-kind", "warm", "--out", str(out), "--port", str(port),
            "--hardware", "test", "--commit", "abc1234", "--limit-s", "120", "--stack-dumps-at", "0",
            "--", sys.executable, str(script), str(port)]  # fmt: skip
    assert main(argv) == 0
    run = json.loads((out / "startup.json").read_text())
    assert len(run["first_ttfa_ms"]) == len(run["steady_ttfa_ms"]) == 5
    assert "stack dump:" in (out / "server.log").read_text()


def test_stack_dump_times_are_seconds_not_below_zero() -> None:
    base = ["--family", "cosyvoice3", "--cache-kind", "cold", "--out", "x"]
    assert parse_args([*base, "--stack-dumps-at", "3,12", "--", "app"]).stack_dumps_at == [3.0, 12.0]
    assert parse_args([*base, "--stack-dumps-at", "", "--", "app"]).stack_dumps_at == []
    with pytest.raises(SystemExit):
        parse_args([*base, "--stack-dumps-at", "-1", "--", "app"])
