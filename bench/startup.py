"""One server start timed end to end: launch -> /health -> /ready -> full speed (no background work
left), the first requests' TTFA against the steady state's, and the server's own start-up timeline.

    python -m bench.startup --family cosyvoice3 --cache-kind cold --out DIR [--port 8000] \
        -- python3 app.py --model M --device cuda --backend vllm --asr-model none --allow-forced-tokens

The command must serve on ``--port`` and honour ``forced_tokens`` (``--allow-forced-tokens``). Writes
``DIR/startup.json`` (``StartupRun``) and the server's output to ``DIR/server.log``; a start that runs past
``--limit-s`` is written too, with what it reached (``error`` says where it stopped). ``--stack-dumps-at``
sends the server SIGUSR1 (``python app.py`` then writes every thread's stack to its log) that many seconds
after ready while the first requests run: what a slow first request waits for, in server.log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from statistics import median
from typing import Any

import httpx
import numpy as np

from bench.load import HttpTarget, Recorder, Workload, prompt_audio

log = logging.getLogger(__name__)
FAMILIES = ("cosyvoice3", "cosyvoice2")
POLL_S = 0.25  # between probes of a starting server
FIRST_REQUESTS = 5
LONG_FIELDS = ("phases", "command", "first_ttfa_parts_ms", "steady_ttfa_parts_ms")  # not in the summary line
STOP_WAIT_S = 60.0  # for the server to exit on SIGINT (app.py: its shutdown grace, then 2 s), then a kill


@dataclass(frozen=True)
class StartupRun:
    """startup.json: seconds since the launch of the server's process, TTFA in ms (one stream at a
    time, ``tokens`` forced speech tokens each); None where the start did not get that far."""

    family: str
    cache: str  # cold: an empty cache root; warm: the same root again, as the cold run left it
    launch_to_health_s: float | None
    launch_to_ready_s: float | None
    launch_to_full_speed_s: float | None  # /ready lists no background phase still running
    hardware: str
    finished: str  # ISO time
    commit: str
    command: list[str]
    tokens: int
    first_ttfa_ms: list[float] = field(default_factory=list)  # the first requests after ready
    # the background phases still running when those first requests went out (e.g. the flow compile):
    # what a visitor right after a start meets
    pending_during_first: list[str] = field(default_factory=list)
    steady_ttfa_ms: list[float] = field(default_factory=list)  # as many again, once at full speed
    # the server's own account of each of those TTFAs (ms: queue, frontend, lm, t2w_wait, t2w_compute;
    # engine.serving.metrics.TTFA_PARTS): what a slow first request spent its time on
    first_ttfa_parts_ms: list[dict[str, float]] = field(default_factory=list)
    steady_ttfa_parts_ms: list[dict[str, float]] = field(default_factory=list)
    # the server's timeline (/ready) at full speed, or as far as it got when the run was stopped
    phases: list[dict[str, Any]] = field(default_factory=list)
    # /ready's stage at ready ("warming": start-up work left, e.g. vLLM still starting while the native LM
    # loop serves) and the LM backend serving new requests then and at full speed (None: not reported)
    stage_at_ready: str | None = None
    lm_backend_at_ready: str | None = None
    lm_backend_at_full_speed: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES or self.cache not in ("cold", "warm"):
            raise ValueError(f"family in {FAMILIES}, cache cold|warm; got {self.family}, {self.cache}")

    @property
    def first_vs_steady(self) -> float | None:
        """The first requests' worst TTFA over the steady median (issue 57's target, warm: <= 1.5)."""
        if not self.first_ttfa_ms or not self.steady_ttfa_ms:
            return None
        return max(self.first_ttfa_ms) / median(self.steady_ttfa_ms)

    def to_json(self) -> dict[str, Any]:
        ratio = self.first_vs_steady
        return asdict(self) | {"first_vs_steady": None if ratio is None else round(ratio, 3)}


class Server:
    """The launched command and the instants it reached, in seconds since its launch."""

    def __init__(self, command: list[str], url: str, log_path: Path):
        self.url, self.command = url.rstrip("/"), command
        self._log = log_path.open("wb")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=default_sigint
        )

    def since_launch(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    async def until(
        self, client: httpx.AsyncClient, path: str, deadline: float, done: Any = None
    ) -> dict[str, Any]:
        """Probe ``path`` until it answers 200 (and ``done(body)``), the server exits or the deadline."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited (rc {self.proc.returncode}) before {path} answered")
            try:
                resp = await client.get(self.url + path, timeout=5.0)
                if resp.status_code == 200 and (done is None or done(resp.json())):
                    return dict(resp.json())
            except httpx.TransportError as err:  # not listening yet
                log.debug("%s: %s", path, err)
            await asyncio.sleep(POLL_S)
        raise TimeoutError(f"{path} did not answer within the time limit")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def default_sigint() -> None:
    """In the server's process, before its command runs: SIGINT back at its default, so that stop()'s SIGINT
    ends it. A shell starts a background job (``cmd &``: a long run, or the whole test suite) with SIGINT
    ignored, and children inherit that: a Python server then never raises KeyboardInterrupt (app.py's uvicorn
    takes SIGINT only once it runs, after the imports), and stop() waited STOP_WAIT_S for it, then killed it
    with no clean-up. Only a signal call between fork and exec: nothing that takes a lock another thread of
    this process could hold."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def full_speed(body: dict[str, Any]) -> bool:
    """/ready's timeline has no phase still running (background graphs, the studio UI)."""
    return not (body.get("startup") or {}).get("pending", [])


async def ttfas(
    target: HttpTarget, workload: Workload, n: int, seed: int
) -> tuple[list[float], list[dict[str, float]]]:
    """``n`` requests one after another -> each one's TTFA (ms) as the client saw it, and its parts as
    the server measured them. Each clones a voice of its own (``visitor_prompt``): the first and the steady
    requests alike pay the prompt's features, as a visitor with a new voice does (with one prompt for all,
    the first request alone paid them, 245-315 ms of its frontend on an H100, and every later one hit the
    server's prompt cache: the ratio compared a miss against hits)."""
    seen, parts = [], []
    for i in range(n):
        rec = Recorder()
        await target.run(workload.request(seed + i, visitor_prompt(seed + i)), rec)
        result = rec.result(i)
        if result.ttfa_ms is None:
            raise RuntimeError(f"request {i} returned no audio")
        seen.append(round(result.ttfa_ms, 1))
        parts.append({k: round(v, 1) for k, v in result.ttfa_parts_ms.items()})
        # logged as it ends: a run cut short (the device call's own limit) keeps it in its log
        spent = ", ".join(f"{k} {v:.0f}" for k, v in parts[-1].items())
        log.info("request %d: TTFA %.1f ms; the server's parts (ms) %s", seed + i, seen[-1], spent)
    return seen, parts


def visitor_prompt(seed: int) -> np.ndarray:
    """A voice per request seed below 200 (its own pitch: 100-199.5 Hz; 3.5 s, as ``prompt_audio``'s); the
    first requests are seeds 0-4, the steady ones 100-104."""
    return prompt_audio(f0=100.0 + 0.5 * (seed % 200))


async def measure(args: argparse.Namespace) -> StartupRun:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    url, workload = f"http://127.0.0.1:{args.port}", Workload(tokens=args.tokens)
    server = Server(args.command, url, out / "server.log")
    deadline = server.t0 + args.limit_s
    reached: dict[str, Any] = {}
    target = HttpTarget(url, 1, sse=True)  # SSE: each request's TTFA parts come with its audio
    # The probes go over the requests' own client (one connection), as a visitor's browser has its connection
    # and code warm from loading the page: with a client of their own, the first request alone paid this
    # client's first connection and lazy set-up, 40-60 ms of its TTFA on GPU hosts (the steady ones none).
    client = target.client
    try:
        await server.until(client, "/health", deadline)
        reached["launch_to_health_s"] = server.since_launch()
        body = await server.until(client, "/ready", deadline)
        reached["launch_to_ready_s"] = server.since_launch()
        reached["pending_during_first"] = list((body.get("startup") or {}).get("pending", []))
        reached |= {"stage_at_ready": body.get("stage"), "lm_backend_at_ready": body.get("lm_backend")}
        dumps = asyncio.create_task(stack_dumps(server, args.stack_dumps_at))
        try:
            first = await ttfas(target, workload, FIRST_REQUESTS, 0)
            reached["first_ttfa_ms"], reached["first_ttfa_parts_ms"] = first
        finally:
            dumps.cancel()
        body = await server.until(client, "/ready", deadline, full_speed)
        reached["launch_to_full_speed_s"] = server.since_launch()
        reached["lm_backend_at_full_speed"] = body.get("lm_backend")
        steady = await ttfas(target, workload, FIRST_REQUESTS, 100)
        reached["steady_ttfa_ms"], reached["steady_ttfa_parts_ms"] = steady
        reached["phases"] = (body.get("startup") or {}).get("phases", [])
    except (TimeoutError, RuntimeError) as err:
        reached["error"] = str(err)
        log.error("start-up run stopped: %s", err)
        if "launch_to_ready_s" in reached:  # the timeline so far: which background phase it was in
            reached["phases"] = await phases_so_far(server)
    finally:
        await target.aclose()
        server.stop()
    return record(args, reached)


async def stack_dumps(server: Server, at_s: list[float]) -> None:
    """SIGUSR1 to the server at each of ``at_s`` seconds from now (cancelled once the first requests end)."""
    t0 = time.monotonic()
    for at in sorted(at_s):
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        if server.proc.poll() is None:
            log.info("stack dump %.0f s after ready", at)
            server.proc.send_signal(signal.SIGUSR1)


async def phases_so_far(server: Server) -> list[dict[str, Any]]:
    """A ready server's timeline now (its finished phases), [] when it no longer answers."""
    try:
        async with httpx.AsyncClient() as client:
            resp = await client.get(server.url + "/ready", timeout=5.0)
        return list((resp.json().get("startup") or {}).get("phases", [])) if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError) as err:
        log.warning("no timeline from the stopped run: %s", err)
        return []


def record(args: argparse.Namespace, reached: dict[str, Any]) -> StartupRun:
    return StartupRun(
        family=args.family,
        cache=args.cache_kind,
        launch_to_health_s=reached.get("launch_to_health_s"),
        launch_to_ready_s=reached.get("launch_to_ready_s"),
        launch_to_full_speed_s=reached.get("launch_to_full_speed_s"),
        hardware=args.hardware,
        finished=datetime.now(UTC).isoformat(timespec="seconds"),
        commit=args.commit or git_commit(),
        command=list(args.command),
        tokens=args.tokens,
        first_ttfa_ms=reached.get("first_ttfa_ms", []),
        pending_during_first=reached.get("pending_during_first", []),
        steady_ttfa_ms=reached.get("steady_ttfa_ms", []),
        first_ttfa_parts_ms=reached.get("first_ttfa_parts_ms", []),
        steady_ttfa_parts_ms=reached.get("steady_ttfa_parts_ms", []),
        phases=reached.get("phases", []),
        stage_at_ready=reached.get("stage_at_ready"),
        lm_backend_at_ready=reached.get("lm_backend_at_ready"),
        lm_backend_at_full_speed=reached.get("lm_backend_at_full_speed"),
        error=reached.get("error"),
    )


def git_commit() -> str:
    """This checkout's commit (+dirty), or COMMIT from the environment where there is no git."""
    try:
        head = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True)
    except OSError:
        return os.environ.get("COMMIT", "unknown")
    return head.stdout.strip() or os.environ.get("COMMIT", "unknown")


def seconds_list(text: str) -> list[float]:
    """'3,12' -> [3.0, 12.0]; '' -> []."""
    values = [float(v) for v in text.split(",") if v.strip()]
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"seconds must be >= 0, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=FAMILIES, required=True)
    p.add_argument("--cache-kind", choices=("cold", "warm"), required=True)
    p.add_argument("--out", required=True, help="a folder: startup.json and server.log")
    p.add_argument("--port", type=int, default=8000, help="where the command serves")
    p.add_argument("--tokens", type=int, default=250, help="forced speech tokens a request")
    p.add_argument("--limit-s", type=float, default=500.0, help="the whole run's bound")
    p.add_argument("--hardware", default="unknown")
    p.add_argument("--commit", default=None, help="default: git describe, or $COMMIT")
    p.add_argument(
        "--stack-dumps-at", type=seconds_list, default=[],
        help="seconds after ready, e.g. 3,12: SIGUSR1 to the server (its thread stacks into server.log)",
    )  # fmt: skip
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server's command line")
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("give the server's command after --")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    run = asyncio.run(measure(args))
    (Path(args.out) / "startup.json").write_text(json.dumps(run.to_json(), indent=2) + "\n")
    # the summary (run.sh shows this line)
    print(json.dumps({k: v for k, v in run.to_json().items() if k not in LONG_FIELDS}))
    return 0 if run.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
